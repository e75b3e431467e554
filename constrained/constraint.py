"""Regex-constrained decoding for the shared loop: a logits mask and a free draft source.

``RegexConstraint`` masks every position the target scores, including each position of a draft,
and follows the accepted tokens through the token index (one table lookup per token).
``ForcedTextSource`` drafts the text the regex forces next (``", "age": `` in a JSON shape) for free.
"""

from typing import Optional

import mlx.core as mx

from constrained.token_index import TokenIndex, load_or_build_index
from decoder import Constraint, Draft, DraftSource, eos_ids_of


class RegexConstraint(Constraint):
    """The DFA state of the accepted text, and the masks for the next positions."""

    def __init__(self, index: TokenIndex):
        self.index = index
        self.reset()

    def reset(self):
        self.state = self.index.start

    @classmethod
    def from_regex(cls, pattern: str, tokenizer, vocab_size: int, cache_dir=None) -> "RegexConstraint":
        return cls(load_or_build_index(pattern, tokenizer, vocab_size, eos_ids_of(tokenizer), cache_dir=cache_dir))

    @classmethod
    def from_json_schema(cls, schema, tokenizer, vocab_size: int, cache_dir=None, **options) -> "RegexConstraint":
        """Output that validates against `schema` (a dict); `options` go to `schema_to_regex`."""
        from constrained.json_schema import schema_to_regex

        return cls.from_regex(schema_to_regex(schema, **options), tokenizer, vocab_size, cache_dir=cache_dir)

    def walk(self, draft: list) -> list:
        """The states before each allowed draft token and after the last one (the loop decides
        what happens to a forbidden token: ``decoder.constrain_draft``)."""
        states = [self.state]
        for token in draft:
            state = self.index.next_state(states[-1], token)
            if state < 0:
                break
            states.append(state)
        return states

    def masks(self, states: list) -> mx.array:
        return self.index.masks(states)

    def advance(self, tokens: list):
        for token in tokens:
            self.state = self.index.next_state(self.state, token)


def tokenize_forced(tokenizer, forced: bytes) -> list:
    """The tokens of the whole characters in ``forced`` (forced bytes can stop inside one)."""
    text = forced.decode("utf-8", errors="ignore") if forced else ""
    return tokenizer.encode(text, add_special_tokens=False) if text else []


class ForcedTextSource(DraftSource):
    """Drafts the bytes the regex forces from the current state, tokenized by the model's tokenizer.

    The tokenization of the forced text on its own may differ from the one the
    model prefers in context; the target verifies it like any draft, so the
    output is unchanged either way (and a token that is the only one allowed is
    always accepted).
    """

    name = "regex"
    free = True  # read off the DFA state

    def __init__(self, constraint: RegexConstraint, tokenizer):
        self.constraint, self.tokenizer = constraint, tokenizer
        self._drafts = {}  # DFA state -> tokenized forced text (states repeat in loops)

    def propose(self, tokens: list, max_draft: int) -> Optional[Draft]:
        state = self.constraint.state
        if state not in self._drafts:
            self._drafts[state] = tokenize_forced(self.tokenizer, self.constraint.index.dfa.forced_bytes(state))
        forced = self._drafts[state]
        return Draft(forced[:max_draft]) if forced else None
