"""Adaptive draft length and pausing, for the sources that run a model (drafter.py's)."""

from mlx.utils import tree_flatten

from decoder.cost import AcceptanceEstimate, Backoff


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


class Calibration:
    """How often a drafting model's top token is accepted, by how confident it was: its top
    probability maps to the acceptance measured for drafts of about that confidence.

    A head or MTP layer can be right far more (or less) often than its probabilities say; the
    stops and trees that read its confidence read this instead. Each bin starts at its own
    confidence (a calibrated model needs no correction) and forgets as ``AcceptanceEstimate``
    does, so a drafter whose accuracy drifts with the text is followed.
    """

    BINS = 10
    PRIOR_WEIGHT = 2.0  # the starting guess counts as this many drafted tokens
    FORGET = 0.98  # per token recorded in a bin: about the last 50 count

    def __init__(self):
        centers = [(i + 0.5) / self.BINS for i in range(self.BINS)]
        self.accepted = [self.PRIOR_WEIGHT * c for c in centers]
        self.drafted = [self.PRIOR_WEIGHT] * self.BINS

    def _bin(self, confidence: float) -> int:
        return min(int(confidence * self.BINS), self.BINS - 1)

    def __call__(self, confidence: float) -> float:
        """The chance a token drafted at ``confidence`` is accepted, once the one before it was."""
        index = self._bin(confidence)
        return self.accepted[index] / self.drafted[index]

    def record(self, confidences: list, num_accepted: int):
        """A verified draft whose tokens had ``confidences``: the first ``num_accepted`` were
        accepted, and the one after them (if any) was the first rejected; the rest were not
        judged."""
        for position, confidence in enumerate(confidences[: num_accepted + 1]):
            index = self._bin(confidence)
            self.accepted[index] = self.FORGET * self.accepted[index] + (position < num_accepted)
            self.drafted[index] = self.FORGET * self.drafted[index] + 1
