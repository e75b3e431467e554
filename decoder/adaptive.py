"""Adaptive draft length and pausing, for the sources that run a model (model_drafter.py's)."""

from mlx.utils import tree_flatten

from decoder.acceptance import AcceptanceEstimate, Backoff


def weight_bytes(model) -> int:
    """Bytes of weights one call of ``model`` reads (a sharded target counts whole): decoding is
    memory-bound, so two models' ratio is a first guess at their step times' until timed."""
    leaves = [value for _, value in tree_flatten(model.parameters())]
    nbytes = sum(value.nbytes for value in leaves)
    whole = getattr(model, "num_parameters", None)  # set by distributed/sharding.py
    return nbytes * whole // max(sum(value.size for value in leaves), 1) if whole else nbytes


class AdaptiveLength:
    """How many tokens to draft next: +2 after a fully accepted draft, -1 otherwise, within
    [1, max_draft]. Drafting pauses while recent drafts gave fewer tokens than they cost, probing
    with one token now and then; ``enabled=False`` keeps ``num_draft`` fixed."""

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
        """``num_draft``, or 0 (pause) or 1 (probe) while drafts do not pay."""
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
        """Tokens per plain step's time the next draft should give:
        (1 + accepted per draft) / (1 + token_cost * drafted per draft)."""
        recent = self.estimate
        return (recent.drafts + recent.accepted) / (recent.drafts + token_cost * recent.proposed)


class Calibration:
    """A drafting model's top probability -> the acceptance measured at about that confidence, for
    the stops and trees: a head can be right far more (or less) often than its probabilities say.
    Each bin starts at its own confidence and forgets, to follow an accuracy that drifts."""

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
        """A verified draft: the first ``num_accepted`` tokens were accepted, the next rejected,
        and the rest not judged."""
        for position, confidence in enumerate(confidences[: num_accepted + 1]):
            index = self._bin(confidence)
            self.accepted[index] = self.FORGET * self.accepted[index] + (position < num_accepted)
            self.drafted[index] = self.FORGET * self.drafted[index] + 1
