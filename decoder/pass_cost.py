"""What a verification pass costs, timed by the loop that runs it (``PassCost``). Every adaptive
choice weighs it against what drafts win (acceptance.py) instead of a constant, since the cost of
width depends on the hardware (docs/decoder.md).

    cost = PassCost()
    cost.record(seconds, width=1 + len(draft), rows=1)  # the loop, after each pass
    cost.token_cost()                                    # a source, choosing its length
"""

import time
from typing import Callable, Optional


class PassCost:
    """Recent timings of target passes by shape, and of each source's drafting. A ``rows`` x
    ``width`` pass is a line, ``base + slope * (width - 1)``, fitted per ``rows``.

    Args:
        default_token_cost: the prior for one more token of width (a fraction of a one-token
            pass) until some batch size has two widths timed.
        forget: the weight of the past in each running mean.
        clock: seconds as a float; tests pass a simulated clock.
    """

    PRIOR_WEIGHT = 0.5  # the prior is half a pass at widths 1 and 2, soon outweighed

    def __init__(
        self,
        default_token_cost: float = 0.09,
        forget: float = 0.9,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if not 0 < default_token_cost:
            raise ValueError(f"default_token_cost must be positive, got {default_token_cost}")
        self.default_token_cost = default_token_cost
        self.forget = forget
        self.clock = clock
        self.passes = {}  # rows -> {width: [weight, mean seconds]}
        self.drafting = {}  # source name -> [weight, mean seconds per drafted token]
        self._fits = {}  # rows -> (base, slope), cleared by each record

    def agreed(self, seconds: float) -> float:
        """A timing as every process decoding in lockstep reads it (sharded: the group's mean);
        any choice made from a timing reads it so."""
        return seconds

    def record(self, seconds: float, width: int, rows: int = 1):
        """One pass of ``rows`` x ``width`` tokens took ``seconds``."""
        entry = self.passes.setdefault(rows, {}).setdefault(width, [0.0, 0.0])
        entry[0] = self.forget * entry[0] + 1
        entry[1] += (seconds - entry[1]) / entry[0]
        self._fits.clear()  # a size's prior reads the other sizes' timings

    def record_draft(self, name: str, seconds: float, num_drafted: int):
        """Source ``name`` took ``seconds`` to draft ``num_drafted`` tokens."""
        if num_drafted <= 0:
            return
        entry = self.drafting.setdefault(name, [0.0, 0.0])
        entry[0] = self.forget * entry[0] + 1
        entry[1] += (seconds / num_drafted - entry[1]) / entry[0]

    def _fit(self, rows: int) -> Optional[tuple]:
        """``(base, slope)`` of the line through the timings at ``rows`` (weighted least squares
        with the prior's two pseudo-passes), or None before any pass of that many rows."""
        if rows in self._fits:
            return self._fits[rows]
        widths = self.passes.get(rows)
        if not widths:
            measured = [r for r in self.passes if self.passes[r]]
            if not measured:
                return None
            # The nearest batch size's line, scaled as if each row cost alike, until measured.
            nearest = min(measured, key=lambda r: abs(r - rows))
            fit = self._fit(nearest)
            return None if fit is None else (fit[0] * rows / nearest, fit[1] * rows / nearest)
        narrowest = min(widths)
        if widths[narrowest][1] <= 0:  # a clock that did not move (a test's): nothing measured
            return None
        prior = self._prior_token_cost(rows)
        anchor = widths[narrowest][1] / (1 + prior * (narrowest - 1))
        points = [(w, weight, mean) for w, (weight, mean) in widths.items()]
        points += [(1, self.PRIOR_WEIGHT, anchor), (2, self.PRIOR_WEIGHT, anchor * (1 + prior))]
        base, slope = _line(points)
        if base <= 0:  # noise on a nearly flat line: keep the measured narrowest pass as the base
            base = widths[narrowest][1]
        fit = self._fits[rows] = (base, max(slope, 0.0))
        return fit

    def _prior_token_cost(self, rows: int) -> float:
        """The relative slope measured at the batch size nearest ``rows`` (a batch whose rows join
        one by one meets new sizes often), else ``default_token_cost``."""
        slopes = {}
        for other, widths in self.passes.items():
            if other != rows and len(widths) >= 2 and all(mean > 0 for _, mean in widths.values()):
                base, slope = _line([(w, weight, mean) for w, (weight, mean) in widths.items()])
                if base > 0:
                    slopes[other] = max(slope, 0.0) / base
        if not slopes:
            return self.default_token_cost
        return slopes[min(slopes, key=lambda other: (abs(other - rows), -other))]

    def seconds(self, width: int = 1, rows: int = 1) -> Optional[float]:
        """The expected seconds of a ``rows`` x ``width`` pass; None before any pass was timed."""
        fit = self._fit(rows)
        return None if fit is None else fit[0] + fit[1] * (width - 1)

    def relative(self, width: int, rows: int = 1) -> float:
        """A ``rows`` x ``width`` pass as a multiple of a ``rows`` x 1 pass."""
        fit = self._fit(rows)
        if fit is None:
            return 1 + self.default_token_cost * (width - 1)
        return 1 + fit[1] / fit[0] * (width - 1)

    def token_cost(self, rows: int = 1) -> float:
        """What one more token of width adds to a pass, as a fraction of a one-token pass."""
        return max(self.relative(2, rows) - 1, 1e-3)

    def draft_seconds(self, name: str) -> Optional[float]:
        """Source ``name``'s mean drafting seconds per token (per position for many rows)."""
        entry = self.drafting.get(name)
        return None if entry is None else entry[1]

    def draft_cost(self, name: str, prior: float) -> float:
        """Source ``name``'s drafting time per token over a one-token pass, else ``prior``."""
        entry, step = self.drafting.get(name), self.seconds()
        if entry is None or not step:
            return prior
        return entry[1] / step

    def summary(self) -> dict:
        """What was measured, for reports: seconds by rows and width, and the fitted token cost."""
        return {
            "passes": {
                rows: {width: round(mean, 6) for width, (_, mean) in sorted(widths.items())}
                for rows, widths in sorted(self.passes.items())
            },
            "token_cost": {rows: round(self.token_cost(rows), 4) for rows in sorted(self.passes)},
            "draft_seconds_per_token": {
                name: round(mean, 6) for name, (_, mean) in self.drafting.items()
            },
        }


def _line(points: list) -> tuple:
    """``(base, slope)`` of the weighted least-squares line through ``(width, weight, seconds)``
    points, in ``width - 1``; at least two distinct widths."""
    total = sum(weight for _, weight, _ in points)
    mean_x = sum(weight * (w - 1) for w, weight, _ in points) / total
    mean_y = sum(weight * t for _, weight, t in points) / total
    spread = sum(weight * (w - 1 - mean_x) ** 2 for w, weight, _ in points)
    slope = sum(weight * (w - 1 - mean_x) * (t - mean_y) for w, weight, t in points) / spread
    return mean_y - slope * mean_x, slope
