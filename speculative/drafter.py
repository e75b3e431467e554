"""What a model that drafts (a draft model, a draft head, MTP layers) shares, for one row or many.

One ``SharedDrafter`` holds the drafting model's cache for every row that drafts with it and drafts
for all of them in one call per step (``draft_all``); each row holds a ``SharedSource`` of it, made
by ``drafter.source()``, in its list of draft sources. Alone, a source's ``propose`` asks its
drafter for its row only; ``batch.BatchGenerator(..., drafters=[drafter])`` asks it for all rows.

The catch-up (the positions each row accepted since its last draft, right-padded to the longest
and fed in chunks, each row then dropping its padding), the per-position drafting loop and a row's
leaving are written here once; a drafter supplies its cache, how it reads the positions a row has
not fed (``_prepare``), one call for one draft position (``_next``) and how it scores (``_draw``).
"""

from typing import NamedTuple, Optional
from weakref import WeakSet

import mlx.core as mx

from decoder.cost import PassCost
from decoder.draft import Draft, DraftSource
from decoder.sampling import sampling_probs
from speculative.adaptive import AdaptiveLength


class DraftRequest(NamedTuple):
    """A row asking its drafter for a draft: its source, its tokens, the most it may draft and its
    row in the target's cache (``slot``)."""

    source: "SharedSource"
    tokens: list
    max_draft: int
    slot: int = 0


def draw_rows(logits: mx.array, sources: list) -> tuple:
    """Per row of ``logits`` (R, V): the token drawn as row r's ``sources[r]`` samples (argmax when
    greedy), the top probability (its confidence) and q (None for greedy rows). Rows that sample
    alike are drawn together."""
    greedy = mx.softmax(logits.astype(mx.float32), axis=-1)
    tokens, confidence = mx.argmax(greedy, axis=-1), mx.max(greedy, axis=-1)
    probs = [None] * len(sources)
    for temp, top_p in {(s.temp, s.top_p) for s in sources if s.temp > 0}:
        members = [i for i, s in enumerate(sources) if (s.temp, s.top_p) == (temp, top_p)]
        group = sampling_probs(logits[mx.array(members)], temp, top_p)
        index = mx.array(members)
        tokens[index] = mx.random.categorical(mx.log(group)).astype(tokens.dtype)
        confidence[index] = group.max(axis=-1)
        for position, member in enumerate(members):
            probs[member] = group[position]
    return tokens, confidence, probs


class SharedSource(DraftSource):
    """One row's source on a ``SharedDrafter``: the row's adaptive length, and ``propose``
    returning what the drafter drafted for it (alone: it asks the drafter for this row only)."""

    def __init__(self, drafter, num_draft: int = 4, max_draft: int = 12, adaptive: bool = True):
        self.drafter = drafter
        self.length = AdaptiveLength(num_draft, max_draft, enabled=adaptive)
        self.reset()

    @property
    def num_draft(self) -> int:
        return self.length.num_draft

    def reset(self, cost: Optional[PassCost] = None, temp: float = 0.0, top_p: float = 1.0):
        """A new generation: the drafter keeps the row's cache and reuses what the new text
        shares with it."""
        super().reset(cost, temp, top_p)
        self.length.reset()
        self.draft, self.drafted = None, False  # from the last draft_all, until proposed
        self.fresh = True

    def token_cost(self) -> float:
        """Drafting and verifying one token, as a fraction of the target's plain pass (measured)."""
        return self.drafter.draft_cost(self.cost) + self.cost.token_cost(self.drafter.batch_rows)

    def forecast_speedup(self) -> Optional[float]:
        return self.length.expected_speedup(self.token_cost()) if self.length.enabled else None

    def propose(self, tokens: list, max_draft: int) -> Optional[Draft]:
        if not self.drafted:  # alone: no batch drafted for this row before it was asked
            self.drafter.draft_alone(DraftRequest(self, tokens, max_draft), self.cost)
        draft, self.draft, self.drafted = self.draft, None, False
        if draft is None or max_draft <= 0:
            return None
        return draft.truncate(max_draft)

    def update(self, tokens: list, num_proposed: int, num_accepted: int):
        self.length.record(num_proposed, num_accepted)


class SharedDrafter:
    """A model drafting for every row that holds one of its sources, in one call per step.

    What a batch asks of it (``batch.BatchGenerator``): ``owns(source)``, ``draft_all`` and
    ``leave``. The time of one draft position over all its rows is kept in the loop's ``PassCost``
    (``record_draft`` as "NAME position", NAME its sources' name, so that ranks decoding in
    lockstep agree on it), as a fraction of the target's plain pass (``draft_cost``).

    Args:
        source_class: the ``SharedSource`` subclass ``source`` makes.
        options: its sources' ``num_draft``, ``max_draft`` and ``adaptive``.
        draft_cost_prior: one draft position as a fraction of a target pass, until timed.
        chunk_size: positions per call when a row catches up (a prompt), as the target's prefill.
    """

    min_confidence = 0.0  # a row stops drafting once its top probability falls below this
    min_tokens = 1  # the shortest text a row drafts after

    def __init__(self, source_class, options: dict, draft_cost_prior: float, chunk_size: int):
        self.source_class, self.options = source_class, options
        self.draft_cost_prior, self.chunk_size = draft_cost_prior, chunk_size
        self.batch_rows = 1  # rows in the target's batch at the last draft
        self.rows = []  # the sources of the rows its cache holds, in cache order
        self.cache = None
        self.sources = WeakSet()  # every source it made

    def source(self) -> SharedSource:
        """A source for one row's ``draft_sources``."""
        source = self.source_class(self, **self.options)
        self.sources.add(source)
        return source

    def owns(self, source: DraftSource) -> bool:
        """Whether ``source`` is one of its own (made by ``source()``)."""
        return source in self.sources

    def draft_cost(self, cost: PassCost) -> float:
        """One draft position (a pass over all its rows) as a fraction of the target's plain pass
        over the batch: both measured, or the prior until they are."""
        target = cost.seconds(1, self.batch_rows)
        drafted = cost.draft_seconds(f"{self.source_class.name} position")
        if drafted is None or not target:
            return self.draft_cost_prior
        return drafted / target

    def leave(self, source: SharedSource):
        """The source's row left the batch: its cache row goes."""
        if source in self.rows:
            index = self.rows.index(source)
            keep = [i for i in range(len(self.rows)) if i != index]
            self._drop_row(index)
            del self.rows[index]
            if keep:
                self.cache.filter(keep)
            else:
                self.cache = None

    def _drop_row(self, index: int):
        """What the drafter keeps per row, beside its cache, loses row ``index``."""

    def _add_rows(self, sources: list, cache):
        """The rows of ``sources`` join, their cache rows in ``cache`` after the others'."""
        if self.cache is None:
            self.cache = cache
        else:
            self.cache.extend(cache)
        self.rows += sources

    def draft_alone(self, request: DraftRequest, cost: PassCost):
        """Draft for one row, outside a batch: rows of other sources, from earlier generations, go
        first (a batch drafts through ``draft_all``)."""
        for source in [s for s in self.rows if s is not request.source]:
            self.leave(source)
        self.draft_all([request], cost, 1)

    def draft_all(self, requests: list, cost: PassCost, batch_rows: int, cache=None):
        """Draft for every row in ``requests`` (``DraftRequest``s); ``batch_rows`` is the target's
        batch size and ``cache`` its cache (None: one row alone, which the target just ran)."""
        self.batch_rows = batch_rows
        for source in self.rows:  # last step's untaken drafts are stale
            source.draft = None
        self._join(requests)
        lengths = {}
        for source, tokens, max_draft, _ in requests:
            source.drafted = True
            if max_draft > 0 and len(tokens) >= self.min_tokens:
                # next_length counts a paused step, so it is asked once per step
                lengths[id(source)] = min(source.length.next_length(source.token_cost()), max_draft)
        requests = [request for request in requests if lengths.get(id(request.source))]
        if not requests:
            return  # the cache catches up in one go when drafting resumes
        tic = cost.clock()
        counts, feed = self._prepare(requests, cache)
        if not any(counts):
            return
        last = self._catch_up(counts, feed)
        lengths = [lengths.get(id(s), 0) if n else 0 for s, n in zip(self.rows, counts)]
        drafts, positions = self._chain(last, lengths)
        cost.record_draft(f"{self.source_class.name} position", cost.clock() - tic, positions)
        for source, (tokens, rows) in zip(self.rows, drafts):
            if tokens:
                source.draft = Draft(tokens, None if source.temp == 0 else self._q(rows))

    def _join(self, requests: list):
        """Before drafting (untimed): rows asking for the first time may join here."""

    def _prepare(self, requests: list, cache) -> tuple:
        """Rows drafting for the first time join, and each drafting row's cache goes back to what
        it shares with its text. Returns, per row, how many positions it feeds now (0: none), and
        ``feed(start, counts, width)``, the drafting model's output (R, width, ...) for positions
        ``[start, start + counts[r])`` of each row's, right-padded to ``width``."""
        raise NotImplementedError

    def _draw(self, last: mx.array) -> tuple:
        """``draw_rows`` from each row's last output (R, ...): token indices, confidence, q."""
        raise NotImplementedError

    def _next(self, last: mx.array, indices: mx.array) -> mx.array:
        """One draft position: each row's output after it is fed the token ``indices`` drew."""
        raise NotImplementedError

    def _tokens(self, indices: list) -> list:
        """Token ids of the drawn indices (a head scores a sub-vocabulary)."""
        return indices

    def _q(self, rows: list) -> mx.array:
        """A row's q over the target's vocabulary, from ``_draw``'s rows."""
        return mx.stack(rows)

    def _path_stop(self, source: SharedSource) -> float:
        """A row stops drafting once the product of its top probabilities falls below this."""
        return 0.0

    def _catch_up(self, counts: list, feed) -> mx.array:
        """Feed each row its ``counts[r]`` positions, chunked like a prefill; returns each row's
        last output (R, ...)."""
        last = None
        for start in range(0, max(counts), self.chunk_size):
            chunk = [min(max(n - start, 0), self.chunk_size) for n in counts]
            width = max(chunk)
            out = feed(start, chunk, width)
            self.cache.rewind([width - n for n in chunk])
            step = out[mx.arange(len(chunk)), mx.array([max(n - 1, 0) for n in chunk])]
            has = mx.array([n > 0 for n in chunk])[:, None]
            last = step if last is None else mx.where(has, step, last)
        return last

    def _chain(self, last: mx.array, lengths: list) -> tuple:
        """Draft up to ``lengths[r]`` tokens per row, one call per position for all rows; returns
        per row ``(tokens, q rows)`` and the positions drafted. After it every row's cache holds
        what it held before. One sync per position: the stops need the values, the next call the
        tokens."""
        drafts = [([], []) for _ in self.rows]
        alive, path = [n > 0 for n in lengths], [1.0] * len(self.rows)
        stops = [self._path_stop(s) if n else 0.0 for s, n in zip(self.rows, lengths)]
        fed = 0
        for position in range(max(lengths)):
            indices, confidence, probs = self._draw(last)
            mx.eval(indices, confidence)
            index_list, confidence_list = self._tokens(indices.tolist()), confidence.tolist()
            for row, (tokens, rows) in enumerate(drafts):
                # The top probability, not the drawn token's: whether to draft position i must
                # not depend on the token drawn there, or sampling would no longer be exact.
                path[row] *= confidence_list[row]
                low = confidence_list[row] < self.min_confidence or path[row] < stops[row]
                if position >= lengths[row] or (position and low):
                    alive[row] = False
                if alive[row]:
                    tokens.append(index_list[row])
                    rows.append(probs[row])
            if position + 1 == max(lengths) or not any(alive):
                break
            last = self._next(last, indices)
            fed += 1
        self.cache.rewind([fed] * len(self.rows))
        return drafts, fed + 1
