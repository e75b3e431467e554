"""Prompt lookup decoding: draft by copying what followed an earlier occurrence of the current
suffix (Saxena, 2023; ``prompt_lookup_num_tokens`` in transformers).

``find_draft`` is the search as a pure function; ``PromptLookupSource`` plugs it into
``decoder.generate_step`` and decides how much to draft from how its past drafts fared.
"""

import math
from collections import defaultdict
from typing import Optional, Sequence

import mlx.core as mx

from decoder.acceptance import AcceptanceEstimate, Backoff
from decoder.draft import Draft, DraftSource
from decoder.pass_cost import PassCost
from decoder.sampling import Sampling
from decoder.tree import is_chain

from .trie import choose, judge

# Never a token id: stops matches and continuations at the edges of the context.
SEPARATOR = -1
# How far back occurrences are compared with the current context to pick the one to copy.
LONGEST_LOOKBACK = 16


def check_search_args(ngram_max: int, ngram_min: int, num_draft: int):
    if not 1 <= ngram_min <= ngram_max:
        raise ValueError(f"Need 1 <= ngram_min <= ngram_max, got {ngram_min} and {ngram_max}.")
    if num_draft < 1:
        raise ValueError(f"num_draft must be at least 1, got {num_draft}.")


def find_draft(
    tokens: Sequence[int],
    *,
    extra_context: Sequence[int] = (),
    ngram_max: int = 3,
    ngram_min: int = 1,
    num_draft: int = 8,
) -> list:
    """Tokens that followed an earlier occurrence of the end of ``tokens``.

    Tries n-grams of ``ngram_max`` down to ``ngram_min`` tokens; the largest size that occurs
    earlier in ``tokens`` or anywhere in ``extra_context`` (e.g. an encoder input) wins. Among its
    occurrences, the one that agrees with the context furthest back (up to ``LONGEST_LOOKBACK``
    tokens) is copied, the most recent on a tie: the same as the most recent match with a larger
    ``ngram_max``. Occurrences with nothing after them are skipped, so the suffix never matches
    itself.

    Args:
        tokens: prompt + generated tokens (non-negative ids).
        extra_context: more tokens to copy from; they count as older than ``tokens``.

    Returns:
        Up to ``num_draft`` token ids; empty when nothing matches.
    """
    check_search_args(ngram_max, ngram_min, num_draft)
    tokens = list(tokens)
    context = list(extra_context) + [SEPARATOR] + tokens if extra_context else tokens
    return search(mx.array(context, mx.int32), len(tokens), ngram_max, ngram_min, num_draft)[0]


def match_lengths(context: mx.array, num_tokens: int, ngram_max: int) -> Optional[mx.array]:
    """Per position j of ``context``: how many tokens before j agree with the end of the context
    (up to ``LONGEST_LOOKBACK``, or ``ngram_max`` if larger), 0 where j is a ``SEPARATOR``; None
    for no tokens."""
    length = context.shape[0]
    # the suffix comes from the tokens alone
    window = min(max(ngram_max, LONGEST_LOOKBACK), num_tokens)
    if window == 0:
        return None
    # windows[j]: the `window` tokens right before position j, newest first, so that match_length[j]
    # counts how many of them equal the end of the context: an occurrence whose continuation starts
    # at j. All positions in one comparison.
    padded = mx.concatenate([mx.full((window,), SEPARATOR, mx.int32), context])
    windows = mx.as_strided(padded, shape=(length, window), strides=(1, 1))[:, ::-1]
    match_length = mx.cumprod(windows == context[length - window :][::-1], axis=1).sum(axis=1)
    # A match must be followed by at least one token of its own segment.
    return mx.where(context != SEPARATOR, match_length, 0)


def search_many(
    context: mx.array, num_tokens: int, ngram_max: int, ngram_min: int, num_matches: int, depth: int
) -> tuple:
    """``search`` for the ``num_matches`` best occurrences: ``(continuations, ngram, start)``,
    the continuations best first (each up to ``depth`` tokens) and the best's n-gram and start."""
    length = context.shape[0]
    match_length = match_lengths(context, num_tokens, ngram_max)
    if match_length is None:
        return [], 0, 0
    # Longest agreement first, the most recent on a tie: one score orders both.
    order = mx.argsort(-(match_length * length + mx.arange(length)))[:num_matches]
    follow = order[:, None] + mx.arange(depth)
    found = mx.where(
        (follow < length) & (match_length[order] >= ngram_min)[:, None],
        context[mx.minimum(follow, length - 1)],
        SEPARATOR,
    )
    summary = mx.stack([match_length[order[0]], order[0]])
    mx.eval(found, summary)  # the one host sync of a search
    rows, (best, start) = found.tolist(), summary.tolist()
    continuations = [row[: row.index(SEPARATOR)] if SEPARATOR in row else row for row in rows]
    return [c for c in continuations if c], best, start


def search(
    context: mx.array, num_tokens: int, ngram_max: int, ngram_min: int, num_draft: int
) -> tuple:
    """``find_draft`` on a ready context: an int32 array whose last ``num_tokens`` entries are the
    tokens, preceded by ``extra_context + [SEPARATOR]`` if any. Returns ``(draft, ngram, start)``:
    the draft, the size of the n-gram it matched and where in ``context`` the copied tokens
    start."""
    length = context.shape[0]
    match_length = match_lengths(context, num_tokens, ngram_max)
    if match_length is None:
        return [], 0, 0
    # The longest agreement wins (so the largest n-gram), the most recent on a tie.
    best = match_length.max()
    start = mx.argmax(mx.where(match_length == best, mx.arange(length), -1))
    follow = start + mx.arange(num_draft)
    draft = mx.where(
        (follow < length) & (best >= ngram_min), context[mx.minimum(follow, length - 1)], SEPARATOR
    )
    # The one host sync of a search: the loop needs the draft as Python ints.
    *draft, ngram, start = mx.concatenate(
        [draft, mx.stack([best, start]).astype(mx.int32)]
    ).tolist()
    return (draft[: draft.index(SEPARATOR)] if SEPARATOR in draft else draft), ngram, start


class PromptLookupSource(DraftSource):
    """A draft source that copies from the prompt and the text generated so far.

    Adaptive drafting (``adaptive=True``) follows from what verification costs. Scoring one more
    draft token adds ``c`` of a decoding step, the token cost the loop measures
    (``PassCost.token_cost``: a good share of a step on a CPU, far less on a GPU), while each
    accepted token saves a whole step. If a copied token is accepted with probability ``a`` once the
    token before it was, the i-th draft token pays off while ``a**i > c``, so the best draft length
    is ``log(c) / log(a)``, capped at ``2 * num_draft``.

    ``a`` is estimated for each kind of match apart (``match_kind``: a 3-gram match is a safer copy
    than a 1-gram one) from its recent drafts (``AcceptanceEstimate``). It starts where the best
    length is ``num_draft``. A kind whose copies do not pay (best length 0) is skipped, but probed
    with a one-token draft now and then (``Backoff``), so text that turns repetitive is picked up
    again. With ``adaptive=False`` it always drafts ``num_draft`` tokens when it finds a match.

    The context (``extra_context`` and ``tokens``) is kept as one MLX array that grows by the
    newly accepted tokens, so each step costs one vectorized search and no list conversion.
    The source follows one generation: a different ``tokens`` list starts it over.
    """

    name = "prompt_lookup"

    def __init__(
        self,
        ngram_max: int = 3,
        ngram_min: int = 1,
        num_draft: int = 8,
        extra_context: Sequence[int] = (),
        adaptive: bool = True,
    ):
        check_search_args(ngram_max, ngram_min, num_draft)
        if any(token < 0 for token in extra_context):
            raise ValueError("extra_context must hold token ids (non-negative integers).")
        self.ngram_max, self.ngram_min, self.num_draft = ngram_max, ngram_min, num_draft
        self.extra_context = list(extra_context)
        self.adaptive = adaptive
        self.max_draft_length = 2 * num_draft
        self.reset()

    def reset(
        self, sampling: Sampling = Sampling(), processors=(), cost: Optional[PassCost] = None
    ):
        """Forget the followed sequence and the drafting history (the loop calls this per
        generation)."""
        super().reset(sampling, processors, cost)
        self._tokens = None  # the list being followed
        self._context = mx.array(
            self.extra_context + [SEPARATOR] if self.extra_context else [], mx.int32
        )
        self._num_seen = 0  # how many of the tokens are in self._context
        # Per kind of match, with a prior whose best length is num_draft.
        prior = self.cost.token_cost() ** (1 / (self.num_draft + 0.5))
        self._estimates = defaultdict(lambda: AcceptanceEstimate(prior))
        self._backoffs = defaultdict(Backoff)
        self._kind = None  # the kind of match of the last draft
        self._offered = None  # (len(tokens), draft) of the last draft proposed
        self._offered_tree = False  # whether it was a tree's best branch
        # How often another match's token is right where the favoured one is wrong (``judge``).
        self._second = AcceptanceEstimate(0.5)
        self._continuations = None  # (len(tokens), the matches' continuations) of the last tree

    def match_kind(self, ngram: int, start: int):
        """Matches of one kind share an acceptance estimate. Here: the n-gram size, where agreements
        longer than ``ngram_max`` count as one size (they are all long)."""
        return min(ngram, self.ngram_max)

    def expected_speedup(self, kind, length: int) -> float:
        """Tokens a ``length``-token copy after a match of ``kind`` is expected to give, per
        plain step's time: (1 + a + a^2 + ... + a^length) / (a pass of 1 + length tokens)."""
        accept = self._estimates[kind].rate
        return (1 + sum(accept**i for i in range(1, length + 1))) / self.cost.relative(1 + length)

    def draft_length(self, kind) -> int:
        """The draft length that pays best for a match of ``kind`` (``match_kind``)."""
        accept, token_cost = self._estimates[kind].rate, self.cost.token_cost()
        if accept <= token_cost:
            return 0
        if accept >= 1.0:
            return self.max_draft_length
        return min(int(math.log(token_cost) / math.log(accept)), self.max_draft_length)

    def _follow(self, tokens: list):
        # generate_step passes the same growing list every step; another list is a new generation.
        if tokens is not self._tokens:
            self.reset(self.sampling, self.processors, self.cost)
            self._tokens = tokens
        if len(tokens) > self._num_seen:
            # Lazy: computed by the search's one sync, so the graph never grows.
            self._context = mx.concatenate(
                [self._context, mx.array(tokens[self._num_seen :], mx.int32)]
            )
            self._num_seen = len(tokens)

    def propose(
        self, tokens: list, max_draft: int, max_nodes: Optional[int] = None
    ) -> Optional[Draft]:
        """A copy of what followed the longest match; with ``max_nodes``, a tree of the best
        matches' copies (``_propose_tree``)."""
        if max_nodes is not None:
            return self._propose_tree(tokens, max_draft, max_nodes)
        self._follow(tokens)
        longest = self.max_draft_length if self.adaptive else self.num_draft
        draft, ngram, start = search(
            self._context, len(tokens), self.ngram_max, self.ngram_min, min(max_draft, longest)
        )
        if not draft:
            return None
        kind = self._kind = self.match_kind(ngram, start)
        if not self.adaptive:
            return Draft(draft)
        length = self.draft_length(kind)
        if length == 0:  # copies from this kind of match do not pay: skip, probing now and then
            if not self._backoffs[kind].probe():
                return None
            length = 1
        draft = draft[:length]
        self._offered, self._offered_tree = (len(tokens), draft), False
        # With it, the loop can hand the step to a model source that expects more
        # (draft.choose_draft).
        return Draft(draft, expected_speedup=self.expected_speedup(kind, len(draft)))

    def _propose_tree(self, tokens: list, max_draft: int, max_nodes: int) -> Optional[Draft]:
        """The continuations of the best matches merged into a trie (``trie.choose``): the best
        match's copy is drafted as a chain would be, and other continuations where their chance
        of acceptance pays for them. ``max_nodes`` 0: up to ``2 * num_draft`` nodes."""
        self._follow(tokens)
        cap = max_nodes or self.max_draft_length
        depth = min(max_draft, self.max_draft_length if self.adaptive else self.num_draft)
        continuations, ngram, start = search_many(
            self._context, len(tokens), self.ngram_max, self.ngram_min, 2 * cap, depth
        )
        if not continuations:
            return None
        kind = self._kind = self.match_kind(ngram, start)
        if self.adaptive and self.draft_length(kind) == 0:  # as a chain: skip, or probe
            if not self._backoffs[kind].probe():
                return None
            continuations, cap = continuations[:1], 1
        rate = self._estimates[kind].rate
        token_cost = self.cost.token_cost() if self.adaptive else None
        second = self._second.rate if self.adaptive else 1.0
        draft, expected, main_depth = choose(continuations, rate, token_cost, cap, depth, second)
        self._continuations = (len(tokens), continuations)
        # The best match's copy is scored as a chain's is (``update``).
        self._offered = (len(tokens), continuations[0][: max(main_depth, 1)])
        self._offered_tree = main_depth < len(draft.tokens)
        if is_chain(draft.parents):
            draft.parents = None
        draft.expected_speedup = expected / self.cost.relative(1 + len(draft.tokens))
        return draft

    def update(self, tokens: list, num_proposed: int, num_accepted: int) -> None:
        offered, self._offered = self._offered, None
        if self._continuations is not None:
            start, continuations = self._continuations
            self._continuations = None
            for right in judge(continuations, tokens[start:]):
                self._second.record(1, int(right))
        if not self.adaptive or (num_proposed == 0 and offered is None):
            return
        estimate = self._estimates[self._kind]
        # Another source drafted over the copy, or it was a tree's best branch: score it as if
        # verified alone.
        if num_proposed == 0 or self._offered_tree:
            start, draft = offered
            num_accepted = estimate.score(draft, tokens[start:])
        else:
            estimate.record(num_proposed, num_accepted)
        if num_accepted:
            self._backoffs[self._kind].reset()
