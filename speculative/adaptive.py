"""Adaptive draft length and pausing, and what the batched drafters share (a draft model, a draft
head, MTP layers): one ``Drafter`` drafts for all its rows, each row holding a ``DrafterHandle``."""

from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from decoder.cost import AcceptanceEstimate, Backoff, PassCost
from decoder.draft import Draft, DraftSource, sampling_probs


def weight_bytes(model) -> int:
    """Bytes of weights one call of ``model`` reads (a sharded target counts as a whole).
    Decoding is memory-bound, so the ratio of two models' bytes is a first guess at the
    ratio of their step times, until the loop has timed both (``cost.PassCost``)."""
    leaves = [value for _, value in tree_flatten(model.parameters())]
    nbytes = sum(value.nbytes for value in leaves)
    # set by distributed/sharding.py: the whole model's count
    whole = getattr(model, "num_parameters", None)
    return nbytes * whole // max(sum(value.size for value in leaves), 1) if whole else nbytes


class AdaptiveLength:
    """How many tokens to draft next, learned from how the last drafts fared.

    +2 after a fully accepted draft, -1 otherwise, within [1, max_draft]. Drafting pauses while the
    recent drafts (``AcceptanceEstimate``) gave fewer tokens than they cost (``token_cost`` per
    drafted token, as a fraction of a target step, from the loop's measurements), probing with one
    token now and then (``Backoff``).

    Args:
        num_draft, max_draft: the length to start with (the fixed one when not ``enabled``), the
        longest.
        enabled: False keeps ``num_draft`` fixed and never pauses.
    """

    def __init__(self, num_draft: int, max_draft: int, enabled: bool = True):
        self.max_draft = max(max_draft, num_draft)
        self.enabled = enabled
        self.initial_num_draft = num_draft
        self.reset()

    def reset(self):
        """Start over, as for a new generation."""
        self.num_draft = self.initial_num_draft
        self.estimate, self.backoff = AcceptanceEstimate(), Backoff()

    def next_length(self, token_cost: float) -> int:
        """How many tokens to draft this step, when a drafted token costs ``token_cost`` of a
        step: ``num_draft``, or 0 (pause) or 1 (probe) while drafts do not pay."""
        if not self.enabled or self.expected_speedup(token_cost) > 1:
            self.backoff.reset()
            return self.num_draft
        return 1 if self.backoff.probe() else 0

    def record(self, num_proposed: int, num_accepted: int):
        if not num_proposed or not self.enabled:
            return
        self.estimate.record(num_proposed, num_accepted)
        full = num_accepted == num_proposed
        self.num_draft = (
            min(self.num_draft + 2, self.max_draft) if full else max(self.num_draft - 1, 1)
        )

    def expected_speedup(self, token_cost: float) -> float:
        """What the next draft is expected to give, from the recent ones: tokens emitted per
        plain step's time, (1 + accepted per draft) / (1 + token_cost * tokens drafted per
        draft)."""
        recent = self.estimate
        return (recent.drafts + recent.accepted) / (recent.drafts + token_cost * recent.proposed)


def draw_rows(logits: mx.array, handles: list) -> tuple:
    """Per row of ``logits`` (R, V): the token drawn as row r's ``handles[r]`` samples (argmax when
    greedy), the top probability (its confidence) and q (None for greedy rows). Rows that sample
    alike are drawn together."""
    greedy = mx.softmax(logits.astype(mx.float32), axis=-1)
    tokens, confidence = mx.argmax(greedy, axis=-1), mx.max(greedy, axis=-1)
    probs = [None] * len(handles)
    for temp, top_p in {(h.temp, h.top_p) for h in handles if h.temp > 0}:
        members = [i for i, h in enumerate(handles) if (h.temp, h.top_p) == (temp, top_p)]
        group = sampling_probs(logits[mx.array(members)], temp, top_p)
        index = mx.array(members)
        tokens[index] = mx.random.categorical(mx.log(group)).astype(tokens.dtype)
        confidence[index] = group.max(axis=-1)
        for position, member in enumerate(members):
            probs[member] = group[position]
    return tokens, confidence, probs


class DrafterHandle(DraftSource):
    """One row's handle on a drafter that drafts for one row or many at once (``batch_drafter``,
    ``draft_all``): the row's adaptive length, and ``propose`` returning what was drafted for it.
    Alone, ``propose`` asks the drafter for this row only."""

    def _bind(self, drafter, num_draft: int, max_draft: int, adaptive: bool):
        self.drafter = self.batch_drafter = drafter
        self.length = AdaptiveLength(num_draft, max_draft, enabled=adaptive)
        self.draft, self.drafted = None, False  # from the last draft_all, until proposed
        self.reset()

    @property
    def num_draft(self) -> int:
        return self.length.num_draft

    def reset(self, cost: Optional[PassCost] = None, temp: float = 0.0, top_p: float = 1.0):
        super().reset(cost, temp, top_p)
        self.length.reset()
        self.draft, self.drafted = None, False

    def token_cost(self) -> float:
        """Drafting and verifying one token, as a fraction of the target's plain pass (measured)."""
        return self.drafter.draft_cost(self.cost) + self.cost.token_cost(self.drafter.batch_rows)

    def forecast_speedup(self) -> Optional[float]:
        return self.length.expected_speedup(self.token_cost()) if self.length.enabled else None

    def propose(self, tokens: list, max_draft: int) -> Optional[Draft]:
        if not self.drafted:  # alone: no batch drafted for this row before it was asked
            self.drafter.draft_all([(self, tokens, max_draft)], self.cost, 1)
        draft, self.draft, self.drafted = self.draft, None, False
        if draft is None or max_draft <= 0:
            return None
        return draft.truncate(max_draft)

    def update(self, tokens: list, num_proposed: int, num_accepted: int):
        self.length.record(num_proposed, num_accepted)

    def leave(self):
        self.drafter.remove(self)


class Drafter:
    """What every batched drafter shares: its handles' options, and the time of one draft position
    over all its rows, kept in the loop's ``PassCost`` (``record_draft`` as "NAME position", NAME
    the handles' name, so that ranks decoding in lockstep agree on it), as a fraction of the
    target's plain pass (``draft_cost``).

    Args:
        handle_class: the ``DrafterHandle`` subclass ``source`` makes.
        options: the handles' ``num_draft``, ``max_draft`` and ``adaptive``.
        draft_cost_prior: one draft position as a fraction of a target pass, until timed.
    """

    def __init__(self, handle_class, options: dict, draft_cost_prior: float):
        self.handle_class, self.options = handle_class, options
        self.draft_cost_prior = draft_cost_prior
        self.batch_rows = 1  # rows in the target's batch at the last draft

    def source(self):
        """A handle for one row's ``draft_sources``."""
        handle = self.handle_class.__new__(self.handle_class)
        handle._bind(self, **self.options)
        return handle

    def draft_cost(self, cost: PassCost) -> float:
        """One draft position (a pass over all its rows) as a fraction of the target's plain pass
        over the batch: both measured, or the prior until they are."""
        target, drafted = (
            cost.seconds(1, self.batch_rows),
            cost.draft_seconds(f"{self.handle_class.name} position"),
        )
        if drafted is None or not target:
            return self.draft_cost_prior
        return drafted / target

    def _begin(self, requests: list, batch_rows: int):
        """A step's drafting starts: last step's untaken drafts are stale, and the asking rows are
        drafted for."""
        self.batch_rows = batch_rows
        for handle in self.rows:
            handle.draft = None
        for handle, _, _ in requests:
            handle.drafted = True

    def _time(self, cost: PassCost, seconds: float, positions: int):
        cost.record_draft(f"{self.handle_class.name} position", seconds, positions)
