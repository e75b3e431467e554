"""Generated tokens' logprobs in OpenAI's terms: each token's text and bytes beside its logprob and
the most likely alternatives (``batch.TokenLogprobs`` gives ids and numbers)."""

import math
from dataclasses import dataclass


@dataclass
class OpenAILogprob:
    """One generated token as OpenAI reports it: its text and bytes, its logprob and the top
    ones."""

    token: str
    bytes: list
    logprob: float
    top: list  # (token, bytes, logprob) of the most likely tokens, most likely first


class TokenLogprobNames:
    """Names the tokens of a ``batch.TokenLogprobs`` by the vocabulary's bytes, read once, on the
    first use (special tokens by their decoded text)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.token_bytes = None  # per token id, its bytes (None: a special token)

    def __call__(self, token: int, found) -> OpenAILogprob:
        """``found`` (``batch.TokenLogprobs``) of ``token``. A -inf logprob (a NaN-scored token) is
        reported as -9999.0, as OpenAI floors it; forbidden (-inf) top tokens are left out."""
        top = [
            (*self.describe(i), value)
            for i, value in zip(found.top_ids, found.top_logprobs)
            if math.isfinite(value)
        ]
        logprob = found.logprob if math.isfinite(found.logprob) else -9999.0
        return OpenAILogprob(*self.describe(token), logprob, top)

    def describe(self, token_id: int) -> tuple:
        """``(text, bytes)`` of a token."""
        if self.token_bytes is None:
            from constrained.token_index import token_byte_strings

            try:
                self.token_bytes = token_byte_strings(self.tokenizer, self.vocab_size)
            except ValueError:  # a vocabulary written in neither byte-level nor SentencePiece style
                self.token_bytes = [None] * self.vocab_size
        raw = self.token_bytes[token_id] if token_id < len(self.token_bytes) else None
        raw = raw if raw is not None else self.tokenizer.decode([token_id]).encode()
        return raw.decode("utf-8", errors="replace"), list(raw)
