"""The batch's policies: how many draft tokens each row verifies in this step's pass
(``choose_width``), and which waiting prompts are prefilled together (``prefill_group``).

A ``[B, W]`` pass verifies up to ``W - 1`` draft tokens of every row. Its cost grows with both B
and W, and how fast depends on the machine: on a CPU a draft token can cost about as much as
another row, on a GPU nearly nothing. So the generator times its own passes into a
``PassCost`` and ``choose_width`` weighs each width's expected tokens against that measured cost,
with each row's expected acceptance from ``Acceptance``.
"""

from typing import Optional, Sequence

from decoder.cost import PassCost

# Waiting prompts are prefilled together while the padding stays within this share of their tokens.
MAX_PREFILL_PADDING = 0.15


class Acceptance:
    """A row's running estimate, per source, of the chance a drafted token is accepted once the one
    before it was (as ``PromptLookupSource`` keeps per kind of match).

    Every offered draft is scored against what the step emitted, verified or not: greedy, a draft
    would have been accepted exactly as far as it agrees; a point-mass draft token x is accepted
    with p(x), the chance that the emitted token is x. So rows whose drafts the policy skips still
    learn. A draft agreeing with all that was emitted is censored: its end is unknown.
    """

    FORGET = 0.8  # about the last 5 drafts count
    PRIOR = 0.5  # worth two drafts

    def __init__(self):
        self.counts = {}

    def rate(self, name: str) -> float:
        continued, stopped = self.counts.get(name, (2 * self.PRIOR, 2 * (1 - self.PRIOR)))
        return continued / (continued + stopped)

    def record(self, name: str, offered: list, emitted: list):
        compared = min(len(offered), len(emitted))
        agree = next((i for i in range(compared) if offered[i] != emitted[i]), compared)
        continued, stopped = self.counts.get(name, (2 * self.PRIOR, 2 * (1 - self.PRIOR)))
        self.counts[name] = (
            self.FORGET * continued + agree,
            self.FORGET * stopped + (agree < compared),
        )


class DraftGate:
    """Whether to ask the rows' sources for drafts this step at all.

    Asking costs every row a search (a measurable share of a step on a CPU, where the policy then
    often verifies no draft anyway), and it pays only when it changes the pass.
    So the gate asks while the last step it asked for drafted (``choose_width`` chose W > 1); after
    a step that drafted nothing it skips 1, 2, 4, then ``MAX_PROBE_GAP`` steps between probes, so a
    row whose text turns repetitive is drafted for again within a few steps. New rows reset it.
    Sources that are free to ask (``DraftSource.free``: text a constraint forces) are asked on every
    step all the same. Like the width, this depends on past steps only, so sampling stays exact.
    """

    MAX_PROBE_GAP = 8

    def __init__(self):
        self.reset()

    def reset(self):
        self.skipped, self.probe_gap, self.drafted = 0, 1, True

    def ask(self) -> bool:
        if self.drafted:
            return True
        self.skipped += 1
        if self.skipped <= self.probe_gap:
            return False
        self.skipped, self.probe_gap = 0, min(2 * self.probe_gap, self.MAX_PROBE_GAP)
        return True

    def record(self, width: int):
        """The width chosen on a step the gate asked for."""
        self.drafted = width > 1
        if self.drafted:
            self.probe_gap = 1


def choose_width(
    draft_lengths: Sequence[int],
    acceptance: Sequence[float],
    cost: PassCost,
    max_width: Optional[int] = None,
    batch_rows: Optional[int] = None,
) -> int:
    """The pass width ``W`` (1 + draft tokens per row) that maximises expected tokens per second.

    Row b drafts ``min(d_b, W - 1)`` tokens; if each is accepted with chance ``a_b`` once the one
    before it was, the row is expected to emit ``1 + a_b + a_b^2 + ...`` tokens. A ``[B, W]`` pass
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
            a ** (width - 1) for d, a in zip(draft_lengths, acceptance) if d >= width - 1
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
