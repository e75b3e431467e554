"""Whether draft trees pay on this machine, measured: under ``tree_nodes="auto"`` the loops draft
trees only while the steps that drafted them emit more tokens per second than the steps that
drafted chains.

A tree verifies more draft tokens per pass than a chain, for more accepted tokens per pass; what
that costs (a wider pass, its mask, moving the accepted path into place, a drafter's wider calls)
depends on the machine, the model and the batch, and the width policy prices only the pass. So
``TreeChoice`` compares whole steps (a batch's as speedups over plain decoding at its size): both
kinds in turn, then chains unless trees are clearly faster, probing the other now and then
(``Backoff``). It reads past steps only, so sampling stays exact.
"""

from decoder.acceptance import Backoff


class TreeChoice:
    """Trees or chains for the next step, by each kind's speed over its recent steps."""

    WARMUP = 4  # steps of each kind, taken in turn, before the choice
    FORGET = 0.9  # per step recorded: about a kind's last 10 steps count
    # trees only while this much faster: their extra tokens go to the rows that copy well, and a
    # burst of requests waits for its slowest
    MARGIN = 0.1

    def __init__(self):
        self.tokens = {True: 0.0, False: 0.0}
        self.seconds = {True: 0.0, False: 0.0}
        self.steps = {True: 0, False: 0}
        self.backoff = Backoff()

    def rate(self, trees: bool) -> float:
        """The recent speed of steps that drafted trees (``trees``) or chains."""
        return self.tokens[trees] / self.seconds[trees] if self.seconds[trees] else 0.0

    def use_trees(self) -> bool:
        if min(self.steps.values()) < self.WARMUP:
            return self.steps[True] <= self.steps[False]
        trees_pay = self.rate(True) > (1 + self.MARGIN) * self.rate(False)
        return trees_pay != self.backoff.probe()  # the other kind now and then

    def record(self, trees: bool, tokens: int, seconds: float, plain: float = 1.0):
        """A step that drafted ``trees`` (or chains) emitted ``tokens`` in ``seconds``, drafting
        included; ``plain``: seconds per token of plain decoding at the step's batch size."""
        self.tokens[trees] = self.FORGET * self.tokens[trees] + tokens * plain
        self.seconds[trees] = self.FORGET * self.seconds[trees] + seconds
        self.steps[trees] += 1
