"""Adaptive draft length and pausing, for the sources that run a model (drafter.py's and
``AdaptiveSource``'s)."""

from typing import Optional

from mlx.utils import tree_flatten

from decoder.cost import PassCost
from decoder.draft import DraftSource


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
    recent drafts gave fewer tokens than they cost (``token_cost`` per drafted token, as a fraction
    of a target step, from the loop's measurements), probing with one token after 1, 2, 4 ...
    skipped steps.

    Args:
        num_draft, max_draft: the length to start with (the fixed one when not ``enabled``), the
        longest.
        enabled: False keeps ``num_draft`` fixed and never pauses.
    """

    FORGET = 0.8  # weight of the past in the acceptance estimate: about the last 5 drafts count
    MAX_PROBE_GAP = 64

    def __init__(self, num_draft: int, max_draft: int, enabled: bool = True):
        self.max_draft = max(max_draft, num_draft)
        self.enabled = enabled
        self.initial_num_draft = num_draft
        self.reset()

    def reset(self):
        """Start over, as for a new generation."""
        self.num_draft = self.initial_num_draft
        # prior: two one-token drafts, one accepted
        self.drafts, self.accepted, self.proposed = 2.0, 1.0, 2.0
        self.skipped, self.probe_gap = 0, 1

    def next_length(self, token_cost: float) -> int:
        """How many tokens to draft this step, when a drafted token costs ``token_cost`` of a
        step: ``num_draft``, or 0 (pause) or 1 (probe) while drafts do not pay."""
        if not self.enabled or self.expected_speedup(token_cost) > 1:
            self.probe_gap = 1
            return self.num_draft
        self.skipped += 1
        if self.skipped <= self.probe_gap:
            return 0
        self.skipped, self.probe_gap = 0, min(2 * self.probe_gap, self.MAX_PROBE_GAP)
        return 1

    def record(self, num_proposed: int, num_accepted: int):
        if not num_proposed or not self.enabled:
            return
        self.drafts = self.FORGET * self.drafts + 1
        self.accepted = self.FORGET * self.accepted + num_accepted
        self.proposed = self.FORGET * self.proposed + num_proposed
        full = num_accepted == num_proposed
        self.num_draft = (
            min(self.num_draft + 2, self.max_draft) if full else max(self.num_draft - 1, 1)
        )

    def expected_speedup(self, token_cost: float) -> float:
        """What the next draft is expected to give, from the recent ones: tokens emitted per
        plain step's time, (1 + accepted per draft) / (1 + token_cost * tokens drafted per
        draft)."""
        accepted, proposed = self.accepted / self.drafts, self.proposed / self.drafts
        return (1 + accepted) / (1 + token_cost * proposed)


class AdaptiveSource(DraftSource):
    """A draft source that runs a model. It draws its tokens as the target samples (the loop's
    ``temp``/``top_p``, given to ``reset``), so q is the distribution each was drawn from.

    Args:
        num_draft, max_draft, adaptive: its ``AdaptiveLength``.
        draft_cost_prior: drafting one token as a fraction of a target step, until the loop has
            timed it (``PassCost.draft_cost``); the sources' ``create`` sets it from the weight
            bytes.
    """

    def __init__(self, num_draft: int, max_draft: int, adaptive: bool, draft_cost_prior: float):
        self.length = AdaptiveLength(num_draft, max_draft, enabled=adaptive)
        self.draft_cost_prior = draft_cost_prior

    def reset(self, cost: Optional[PassCost] = None, temp: float = 0.0, top_p: float = 1.0):
        super().reset(cost, temp, top_p)
        self.length.reset()

    @property
    def num_draft(self) -> int:
        return self.length.num_draft

    def token_cost(self) -> float:
        """Drafting and verifying one token, as a fraction of a target step (measured by the
        loop)."""
        return self.cost.draft_cost(self.name, self.draft_cost_prior) + self.cost.token_cost()

    def forecast_speedup(self) -> Optional[float]:
        """What its next draft is expected to give, from its recent drafts (``AdaptiveLength``)."""
        return self.length.expected_speedup(self.token_cost()) if self.length.enabled else None

    def update(self, tokens: list, num_proposed: int, num_accepted: int):
        self.length.record(num_proposed, num_accepted)
