"""Regex-constrained decoding for the shared loop: a logits mask and a free draft source.

``RegexConstraint`` masks every position the target scores, including each position of a draft,
follows the accepted tokens through the token index (one table lookup per token) and knows the
text the regex forces next (``", "age": `` in a JSON shape), which ``ForcedTextSource`` drafts for
free.
"""

from typing import Optional

import mlx.core as mx

from constrained.json_schema import schema_to_regex
from constrained.token_index import TokenIndex, load_or_build_index
from decoder.draft import Constraint, Draft, DraftSource
from decoder.text import eos_ids_of


class RegexConstraint(Constraint):
    """The DFA state of the accepted text, the masks for the next positions and the text forced
    after them. ``splits``: how the model writes forced text (``TokenSplits``, shared across rows);
    None: no forced text."""

    def __init__(self, index: TokenIndex, splits: Optional["TokenSplits"] = None):
        self.index, self.splits = index, splits
        self._forced = {}  # DFA state -> tokenized forced text (states repeat in loops)
        self.reset()

    def reset(self):
        self.state = self.index.start

    @classmethod
    def from_regex(
        cls, pattern: str, tokenizer, vocab_size: int, cache_dir=None, splits=None
    ) -> "RegexConstraint":
        index = load_or_build_index(
            pattern, tokenizer, vocab_size, eos_ids_of(tokenizer), cache_dir=cache_dir
        )
        return cls(index, splits if splits is not None else TokenSplits(tokenizer))

    @classmethod
    def from_json_schema(
        cls, schema, tokenizer, vocab_size: int, cache_dir=None, **options
    ) -> "RegexConstraint":
        """Output that validates against `schema` (a dict); `options` go to `schema_to_regex`."""
        return cls.from_regex(
            schema_to_regex(schema, **options), tokenizer, vocab_size, cache_dir=cache_dir
        )

    def walk(self, draft: list) -> list:
        """The states before each allowed draft token and after the last one (the loop decides
        what happens to a forbidden token: ``decoder.constrain.constrain_draft``)."""
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

    def forced_after(self, path: list, previous: Optional[int] = None) -> list:
        """The text the regex forces after draft tokens ``path`` ([] where it refuses them), as
        the model writes it after ``path``'s last token (of an empty path: ``previous``)."""
        states = self.walk(path)
        if self.splits is None or len(states) <= len(path):
            return []
        state = states[-1]
        if state not in self._forced:
            forced = self.index.dfa.forced_bytes(state)
            self._forced[state] = tokenize_forced(self.splits.tokenizer, forced)
        return self.splits.apply(self._forced[state], path[-1] if path else previous)


def tokenize_forced(tokenizer, forced: bytes) -> list:
    """The tokens of the whole characters in ``forced`` (forced bytes can stop inside one)."""
    text = forced.decode("utf-8", errors="ignore") if forced else ""
    return tokenizer.encode(text, add_special_tokens=False) if text else []


class TokenSplits:
    """The tokens a model writes in pieces: ``":"`` is one token, but SmolLM2 writes ``":`` then
    ``"``. Where the target writes a prefix of a drafted token instead, ``learn`` keeps the split
    (until it writes the whole token again) and ``apply`` drafts it so. A model's habit: share it
    across rows. The habit depends on the token before: SmolLM2 writes an object's first ``{"`` as
    ``{`` then ``"``, but ``{"`` whole after ``[``. So each split is kept for the token it followed,
    and also, for tokens it has not followed yet, as the latest seen anywhere."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # token -> (the piece the target writes first, the rest's tokens), the latest seen
        self.pieces = {}
        # (token before, token) -> that split, or None where the target wrote it whole
        self.after = {}

    def split(self, token: int, previous: Optional[int] = None) -> Optional[tuple]:
        """How the target is expected to write ``token`` after ``previous``: None if whole."""
        key = (previous, token)
        return self.after[key] if key in self.after else self.pieces.get(token)

    def apply(self, tokens: list, previous: Optional[int] = None) -> list:
        """``tokens`` (forced text following ``previous``) as the target is expected to write
        them."""
        out = []
        for token in tokens:
            split = self.split(token, previous)
            out += [token] if split is None else [split[0]] + self.apply(split[1], split[0])
            previous = out[-1]
        return out

    def learn(self, drafted: int, written: int, previous: Optional[int] = None):
        """The target wrote ``written`` after ``previous`` where the draft had ``drafted``."""
        split = self.split(written, previous)
        # a split piece drafted, the whole token written
        if split is not None and split[0] == drafted:
            self.after[(previous, written)] = None
            self.pieces.pop(written, None)
            return
        whole, piece = self.tokenizer.decode([drafted]), self.tokenizer.decode([written])
        if piece and len(piece) < len(whole) and whole.startswith(piece) and "\ufffd" not in whole:
            rest = self.tokenizer.encode(whole[len(piece) :], add_special_tokens=False)
            # so apply ends
            if all(len(self.tokenizer.decode([token])) < len(whole) for token in rest):
                self.pieces[drafted] = self.after[(previous, drafted)] = (written, rest)


class ForcedSource(DraftSource):
    """Drafts the text its constraint forces (``forced_after``), the way the target writes it;
    where the target writes a drafted token in pieces, the constraint's ``TokenSplits`` learns
    the split. The target verifies it like any draft, so the output is unchanged either way."""

    def __init__(self, constraint):
        self.constraint = constraint
        self._proposed = []

    def propose(self, tokens: list, max_draft: int, max_nodes=None) -> Optional[Draft]:
        forced = self.constraint.forced_after([], tokens[-1] if tokens else None)
        self._proposed = forced[:max_draft]
        return Draft(self._proposed) if self._proposed else None

    def update(self, tokens: list, num_proposed: int, num_accepted: int) -> None:
        # tokens[-1] is the target's token in place of the rejected one
        if num_accepted < num_proposed:
            self.constraint.splits.learn(
                self._proposed[num_accepted], tokens[-1], tokens[-2] if len(tokens) > 1 else None
            )


class ForcedTextSource(ForcedSource):
    """Drafts the bytes a ``RegexConstraint`` forces from its current state, tokenized by the
    model's tokenizer (a token that is the only one allowed is always accepted)."""

    name = "regex"
