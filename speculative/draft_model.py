"""A draft source backed by a small model that shares the target's vocabulary.

The draft model keeps its own trimmable KV cache. After each verification the cache is trimmed back
to the tokens the target accepted, so the two caches always describe the same text.
"""

from typing import Optional

import mlx.core as mx
from mlx_lm.utils import common_prefix_len

from cost import PassCost
from decoder import Draft, prefill, sampling_probs
from cache import CacheKindError, architecture, make_cache
from speculative.adaptive import AdaptiveSource, weight_bytes
from t5 import T5Decoder, is_encoder_decoder


class VocabularyMismatch(ValueError):
    """The draft and target tokenizers disagree (the message is shown to the user)."""


def check_same_vocabulary(draft_tokenizer, target_tokenizer, draft_size: int, target_size: int):
    """Refuse a pair whose tokenizers differ: the draft's token ids would mean other text."""
    # token string -> id: Hugging Face tokenizers and our T5Tokenizer both offer it.
    draft_vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if len(draft_vocab) != len(target_vocab):
        raise VocabularyMismatch(f"the draft tokenizer has {len(draft_vocab)} tokens, the target's "
                                 f"{len(target_vocab)}; a draft model must share the target's vocabulary")
    differing = [token for token, index in target_vocab.items() if draft_vocab.get(token) != index]
    if differing:
        raise VocabularyMismatch(
            f"the draft and target tokenizers disagree on {len(differing)} tokens (e.g. {differing[0]!r}); "
            "a draft model must share the target's vocabulary")
    # Embedding tables may be padded past the tokenizer (Qwen2.5-7B vs -0.5B): those rows are never text.
    if min(draft_size, target_size) < len(target_vocab):
        raise VocabularyMismatch(f"the draft model has {draft_size} output tokens and the target {target_size}, "
                                 f"fewer than the {len(target_vocab)} tokens of their tokenizer")


def output_size(model, tokenizer) -> int:
    """The width of the model's logits (its config's vocab_size, else the tokenizer's size)."""
    args = getattr(model, "args", None)
    return getattr(args, "vocab_size", None) or len(tokenizer.get_vocab())


class DraftModelSource(AdaptiveSource):
    """Drafts tokens autoregressively with a small model.

    Args:
        model: the draft (mlx-lm model, or ``T5Decoder``).
        vocab_size: the target's output size; the draft distribution is padded or cut to it.
        num_draft, adaptive, max_draft, draft_cost_prior: see ``AdaptiveSource``.
        min_confidence: stop drafting once the draft's top probability falls below this.
    """

    name = "draft_model"

    def __init__(self, model, vocab_size: int, num_draft: int = 4, adaptive: bool = True,
                 max_draft: int = 12, min_confidence: float = 0.5, draft_cost_prior: float = 0.1):
        super().__init__(num_draft, max_draft, adaptive, draft_cost_prior)
        self.model, self.vocab_size, self.min_confidence = model, vocab_size, min_confidence
        self.cache = self._new_cache()
        if self.cache.recurrent:  # its drafts roll back by trimming, which a recurrent state cannot
            raise CacheKindError(f"{architecture(model)}: a draft model with recurrent layers cannot roll back "
                                 "its drafts")
        self.cache_tokens = []  # the tokens whose keys and values are in self.cache
        self.reset()

    @classmethod
    def create(cls, draft_model, draft_tokenizer, target_model, target_tokenizer,
               encoder_input: Optional[list] = None, **kwargs):
        """Check the pair shares a vocabulary, wrap a T5 draft, and build the source."""
        draft_size = output_size(draft_model, draft_tokenizer)
        target_size = output_size(target_model, target_tokenizer)
        check_same_vocabulary(draft_tokenizer, target_tokenizer, draft_size, target_size)
        if is_encoder_decoder(draft_model):
            if encoder_input is None:
                raise VocabularyMismatch("a T5 draft model needs a T5 target model")
            draft_model = T5Decoder(draft_model, encoder_input)
        kwargs.setdefault("draft_cost_prior", weight_bytes(draft_model) / weight_bytes(target_model))
        return cls(draft_model, target_size, **kwargs)

    def reset(self, cost: Optional[PassCost] = None, temp: float = 0.0, top_p: float = 1.0):
        """A new generation: the cache is kept, and reused up to what it shares with the new prompt."""
        super().reset(cost, temp, top_p)
        self.synced = 0  # cache_tokens[:synced] is known to equal the accepted tokens

    def _rewind(self, tokens: list):
        """Trim the cache back to the longest prefix it shares with ``tokens``."""
        # The first ``synced`` tokens are known to match: compare only what follows them.
        common = self.synced + common_prefix_len(self.cache_tokens[self.synced:], tokens[self.synced:])
        self._trim(len(self.cache_tokens) - common)
        self.synced = len(self.cache_tokens)

    def _new_cache(self):
        # Its drafts are one-token calls, rolled back together: a sliding layer keeps that many more.
        return make_cache(self.model, max_rollback=self.length.max_draft + 1)

    def _trim(self, count: int):
        """Drop the cache's last ``count`` tokens; a sliding-window layer that cannot go back that far
        (a new prompt) starts over empty."""
        if count > self.cache.can_trim():
            self.cache, self.cache_tokens = self._new_cache(), []
        else:
            self.cache.rewind([count])
            del self.cache_tokens[len(self.cache_tokens) - count :]

    def _next_distribution(self, new_tokens: list) -> mx.array:
        logits = self.model(mx.array(new_tokens)[None], cache=self.cache.layers)[0, -1, : self.vocab_size]
        self.cache_tokens.extend(new_tokens)
        # Cut (above) or padded to the target's width: its padding rows are never proposed.
        logits = mx.pad(logits, (0, self.vocab_size - logits.shape[-1]), constant_values=-mx.inf)
        if self.temp == 0:  # greedy: the plain softmax, only for the confidence stop
            return mx.softmax(logits.astype(mx.float32))
        return sampling_probs(logits[None], self.temp, self.top_p)[0]

    def propose(self, tokens: list, max_draft: int) -> Optional[Draft]:
        num_draft = min(self.length.next_length(self.token_cost()), max_draft)
        if num_draft == 0:
            return None  # the cache catches up in one batched call when drafting resumes
        self._rewind(tokens)
        if len(self.cache_tokens) == len(tokens):  # re-feed the last token to get its logits
            self._trim(1)
        pending = tokens[len(self.cache_tokens):]
        if len(pending) > 1:  # the prompt, or catching up after a pause: chunked like the target's
            prefill(self.model, self.cache, pending[:-1])
            self.cache_tokens.extend(pending[:-1])
            pending = pending[-1:]
        draft, rows = [], []
        for _ in range(num_draft):
            probs = self._next_distribution(pending)
            token = mx.argmax(probs) if self.temp == 0 else mx.random.categorical(mx.log(probs))
            # One sync per draft token: the next draft step and the early stop need its value.
            token, confidence = token.item(), probs.max().item()
            if draft and confidence < self.min_confidence:
                break
            draft.append(token)
            rows.append(probs)
            pending = [token]
        return Draft(draft, mx.stack(rows) if self.temp > 0 else None)

    def update(self, tokens: list, num_proposed: int, num_accepted: int):
        self._rewind(tokens)
        super().update(tokens, num_proposed, num_accepted)
