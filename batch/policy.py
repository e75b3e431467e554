"""The batch's policies: how many draft tokens each row verifies in this step's pass
(``choose_width``), and which waiting prompts are prefilled together (``prefill_group``).

A ``[B, W]`` pass verifies up to ``W - 1`` draft tokens of every row. Its cost grows with both B
and W, and how fast depends on the machine: on a CPU a draft token can cost about as much as
another row, on a GPU nearly nothing. So the generator times its own passes into a
``PassCost`` and ``choose_width`` weighs each width's expected tokens against that measured cost,
with each row's expected acceptance from ``Acceptance``.
"""

from collections import defaultdict
from typing import Optional, Sequence

from decoder.acceptance import AcceptanceEstimate, Backoff
from decoder.pass_cost import PassCost

# Waiting prompts are prefilled together while the padding stays within this share of their tokens.
MAX_PREFILL_PADDING = 0.15


class Acceptance:
    """A row's ``AcceptanceEstimate`` per source, each offered draft scored against what the step
    emitted, verified or not (``AcceptanceEstimate.score``): so rows whose drafts the policy skips
    still learn."""

    def __init__(self):
        self.by_source = defaultdict(AcceptanceEstimate)

    def rate(self, name: str) -> float:
        return self.by_source[name].rate

    def record(self, name: str, offered: list, emitted: list):
        self.by_source[name].score(offered, emitted)


# The sources that draft the text a row's constraint forces (constrained/'s, by name): asking
# one costs a table lookup, so the gate asks them on every step.
FORCED_TEXT_SOURCES = frozenset({"regex", "grammar", "thinking"})


class DraftGate:
    """Which of the rows' sources to ask for drafts this step.

    Asking costs every row a search (a measurable share of a step on a CPU, where the policy then
    often verifies no draft anyway), and it pays only when it changes the pass.
    So the gate asks while the last step it asked for drafted (``choose_width`` chose W > 1); after
    a step that drafted nothing it asks only to probe (``Backoff``), so a row whose text turns
    repetitive is drafted for again. New rows reset it.
    Sources that are free to ask (named in ``free``: text a constraint forces) are asked on every
    step all the same. Like the width, this depends on past steps only, so sampling stays exact.
    """

    def __init__(self, free: frozenset = FORCED_TEXT_SOURCES):
        self.free = free
        self.reset()

    def reset(self):
        self.backoff, self.drafted = Backoff(), True

    def ask(self) -> bool:
        """Whether to ask every source this step (else only the free ones: ``sources``)."""
        return self.drafted or self.backoff.probe()

    def sources(self, sources: list, asked: bool) -> list:
        """The ones of a row's ``sources`` to ask this step."""
        return sources if asked else [source for source in sources if source.name in self.free]

    def record(self, width: int):
        """The width chosen on a step the gate asked for."""
        self.drafted = width > 1
        if self.drafted:
            self.backoff.reset()


def choose_width(
    draft_lengths: Sequence[int],
    acceptance: Sequence[float],
    cost: PassCost,
    max_width: Optional[int] = None,
    batch_rows: Optional[int] = None,
) -> int:
    """The pass width ``W`` (1 + draft tokens per row) that maximises expected tokens per second.

    Row b drafts ``min(d_b, W - 1)`` tokens; if each is accepted with chance ``a_b`` once the one
    before it was, the row is expected to emit ``1 + a_b + a_b^2 + ...`` tokens. A tree's
    ``acceptance`` is the list of its nodes' chances in the order a narrower pass cuts them
    (``Draft.chances``): it is expected to emit 1 + the sum of those kept. A ``[B, W]`` pass
    costs ``cost.relative(W, B)`` plain passes, measured by the generator on this machine. W = 1
    (no drafts) wins whenever no wider pass is expected to pay for itself. ``batch_rows`` is B
    where the pass also scores cache rows no running row uses (default: one per draft length).
    """
    rows = len(draft_lengths)
    batch_rows = rows if batch_rows is None else batch_rows
    widest = 1 + max(draft_lengths, default=0)
    if max_width is not None:
        widest = min(widest, max_width)
    best_width, best_rate, expected = 1, float(rows), float(rows)
    for width in range(2, widest + 1):
        expected += sum(
            a[width - 2] if isinstance(a, list) else a ** (width - 1)
            for d, a in zip(draft_lengths, acceptance)
            if d >= width - 1
        )
        rate = expected / cost.relative(width, batch_rows)
        if rate > best_rate:
            best_width, best_rate = width, rate
    return best_width


def prefill_group(lengths: Sequence[int]) -> list:
    """Which of the waiting prompts (their ``lengths``, oldest first) to prefill together: the
    oldest and the others whose padding keeps the batch within ``MAX_PREFILL_PADDING`` of its real
    tokens, nearest lengths first. Padding is run like real tokens, so a batch of a 40- and a
    240-token prompt costs more than the two one after the other (benchmarks/results/batch.md,
    "Design measurements")."""
    if not lengths:
        return []
    group = [0]
    for index in sorted(range(1, len(lengths)), key=lambda i: abs(lengths[i] - lengths[0])):
        members = [lengths[i] for i in group + [index]]
        if max(members) * len(members) <= (1 + MAX_PREFILL_PADDING) * sum(members):
            group.append(index)
    return sorted(group)
