"""Whether draft trees pay on this machine, measured: under ``tree_nodes="auto"`` the loops draft
trees only while the steps that drafted them emit more tokens per second than the steps that
drafted chains.

A tree verifies more draft tokens per pass than a chain, for more accepted tokens per pass; what
that costs (a wider pass, its mask, moving the accepted path into place, a drafter's wider calls)
depends on the machine, the model and the batch, and the width policy prices only the pass. So
``TreeChoice`` compares whole steps: both kinds in turn first, then the faster, with the other
probed now and then (``Backoff``) so that a change is followed. The choice depends on past steps
only, so sampling stays exact.
"""

from decoder.acceptance import Backoff


class TreeChoice:
    """Trees or chains for the next step, by each kind's tokens per second over its recent
    steps."""

    WARMUP = 4  # steps of each kind, taken in turn, before the faster is chosen
    FORGET = 0.9  # per step recorded: about a kind's last 10 steps count
    MARGIN = 0.05  # the other kind takes over once this much faster: one noisy step does not

    def __init__(self):
        self.tokens = {True: 0.0, False: 0.0}
        self.seconds = {True: 0.0, False: 0.0}
        self.steps = {True: 0, False: 0}
        self.backoff, self.faster = Backoff(), True

    def rate(self, trees: bool) -> float:
        """Tokens per second of the recent steps that drafted trees (``trees``) or chains."""
        return self.tokens[trees] / self.seconds[trees] if self.seconds[trees] else 0.0

    def use_trees(self) -> bool:
        if min(self.steps.values()) < self.WARMUP:
            return self.steps[True] <= self.steps[False]
        if self.rate(not self.faster) > (1 + self.MARGIN) * self.rate(self.faster):
            self.faster = not self.faster
        return not self.faster if self.backoff.probe() else self.faster

    def record(self, trees: bool, tokens: int, seconds: float):
        """A step that drafted ``trees`` (or chains) emitted ``tokens`` in ``seconds``, drafting
        included."""
        self.tokens[trees] = self.FORGET * self.tokens[trees] + tokens
        self.seconds[trees] = self.FORGET * self.seconds[trees] + seconds
        self.steps[trees] += 1
