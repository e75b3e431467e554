"""What a source's drafts win (``AcceptanceEstimate``) and the backoff of a source whose drafts do
not pay (``Backoff``): what every adaptive choice weighs against a pass's cost (pass_cost.py)."""

from typing import Sequence

from mlx_lm.utils import common_prefix_len


class AcceptanceEstimate:
    """What a source's recent drafts gave, each weighing ``FORGET`` times the next (about the last 5
    count). ``rate``: the chance a token is accepted once the one before it was."""

    FORGET = 0.8

    def __init__(self, prior: float = 0.5):
        self.drafts, self.proposed = 2.0, 2.0
        self.accepted, self.rejected = 2 * prior, 2 * (1 - prior)

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def record(self, num_proposed: int, num_accepted: int):
        self.drafts = self.FORGET * self.drafts + 1
        self.proposed = self.FORGET * self.proposed + num_proposed
        self.accepted = self.FORGET * self.accepted + num_accepted
        self.rejected = self.FORGET * self.rejected + (num_accepted < num_proposed)

    def score(self, offered: Sequence[int], emitted: Sequence[int]) -> int:
        """Record a draft the target did not verify as if it had (accepted as far as it agrees with
        what was emitted, which for a point mass is accepted with p(x)); returns that count."""
        num_accepted = common_prefix_len(offered, emitted)
        self.record(min(len(offered), len(emitted)), num_accepted)
        return num_accepted


class Backoff:
    """Skip-and-probe for a source whose drafts do not pay now but may later (text that turns
    repetitive): ``probe``, asked on each step it pauses, says yes after 1, 2, 4 ... ``MAX_GAP``
    skipped steps; ``reset`` once drafting pays again."""

    # A paused source misses text that turns repetitive for at most 16 steps (about a line), and
    # its probes cost one drafted token (or search) per 17 steps: both small, wherever it runs.
    MAX_GAP = 16

    def __init__(self):
        self.reset()

    def reset(self):
        self.skipped, self.gap = 0, 1

    def probe(self) -> bool:
        self.skipped += 1
        if self.skipped <= self.gap:
            return False
        self.skipped, self.gap = 0, min(2 * self.gap, self.MAX_GAP)
        return True
