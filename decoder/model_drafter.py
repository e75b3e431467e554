"""What a model that drafts (a draft model, a draft head, MTP layers) shares, for one row or many.

One ``SharedDrafter`` holds the drafting model's cache for every row that drafts with it and drafts
for all of them in one call per step; each row holds a ``SharedSource`` of it. The catch-up, the
drafting loop and tree growth are written here once; a drafter supplies ``_prepare``, ``_next`` and
``_draw``.
"""

import weakref
from typing import Optional

import mlx.core as mx
from mlx_lm.utils import common_prefix_len

from decoder.adaptive import AdaptiveLength, Calibration
from decoder.draft import Draft, Drafter, DraftRequest, DraftSource
from decoder.pass_cost import PassCost
from decoder.processors import process_logits
from decoder.sampling import Sampling
from decoder.tree import is_chain
from decoder.tree_growth import TreeGrowth

ALTERNATIVES = 4  # children a tree considers per node beside the most likely (EAGLE-2's top-k)
# The most nodes an ``auto`` tree takes, within what a sliding layer can roll back.
MAX_TREE_NODES = 24


def draw_rows(
    logits: mx.array, sources: list, trees: Optional[list] = None, contexts: Optional[list] = None
) -> tuple:
    """Per row of ``logits`` (R, V): the token drawn as ``sources[r]`` samples (argmax when greedy
    or a tree's: its nodes are point masses), the top probability, q (None when greedy) and, with
    ``trees``, the ``ALTERNATIVES + 1`` most likely tokens and their probabilities. A sampled row
    applies its processors given ``contexts[r]`` (None: not the target's vocabulary)."""
    greedy = mx.softmax(logits.astype(mx.float32), axis=-1)
    tokens, confidence = mx.argmax(greedy, axis=-1), mx.max(greedy, axis=-1)
    top = None
    sampled = [source.sampling.temp > 0 for source in sources]
    if trees is not None:
        top_ids = mx.argsort(-greedy, axis=-1)[:, : ALTERNATIVES + 1]
        top = (top_ids, mx.take_along_axis(greedy, top_ids, axis=-1))
        sampled = [drawn and not tree for drawn, tree in zip(sampled, trees)]
    probs = [None] * len(sources)
    samplings = [source.sampling for source in sources]
    for sampling in {s for s, drawn in zip(samplings, sampled) if drawn}:
        members = [i for i, s in enumerate(samplings) if sampled[i] and s == sampling]
        rows = [
            logits[i : i + 1]
            if contexts is None or not sources[i].processors
            else process_logits(sources[i].processors, contexts[i], [], logits[i : i + 1])
            for i in members
        ]
        group = sampling.probs(mx.concatenate(rows))
        index = mx.array(members, mx.int32)
        tokens[index] = mx.random.categorical(mx.log(group)).astype(tokens.dtype)
        confidence[index] = group.max(axis=-1)
        for position, member in enumerate(members):
            probs[member] = group[position]
    return tokens, confidence, probs, top


class SharedSource(DraftSource):
    """One row's source on a ``SharedDrafter``: its adaptive length and what was drafted for it."""

    def __init__(self, drafter, num_draft: int = 4, max_draft: int = 12, adaptive: bool = True):
        self.drafter = drafter
        self.length = AdaptiveLength(num_draft, max_draft, enabled=adaptive)
        self.reset()

    @property
    def num_draft(self) -> int:
        return self.length.num_draft

    def reset(
        self, sampling: Sampling = Sampling(), processors=(), cost: Optional[PassCost] = None
    ):
        """A new generation; the drafter reuses what the new text shares with the row's cache."""
        super().reset(sampling, processors, cost)
        self.length.reset()
        self.draft, self.drafted = None, False  # from the last draft_all, until proposed
        self.offered = None  # (len(tokens), chain, confidences) of the last draft
        self.offered_tree = False  # whether it went out as a tree
        self.fresh = True

    def token_cost(self) -> float:
        """Drafting and verifying one token, as a fraction of the target's plain pass (measured)."""
        return self.drafter.draft_cost(self.cost) + self.cost.token_cost(self.drafter.batch_rows)

    def forecast_speedup(self) -> Optional[float]:
        return self.length.expected_speedup(self.token_cost()) if self.length.enabled else None

    def propose(self, tokens: list, max_draft: int, max_nodes=None) -> Optional[Draft]:
        """A chain, or with ``max_nodes`` (0: as many as pay) a tree around the greedy chain: what
        the drafter drafted for the row, or drafts now for it alone."""
        if not self.drafted:  # alone: no batch drafted for this row before it was asked
            request = DraftRequest(self, tokens, max_draft, max_nodes=max_nodes)
            self.drafter.draft_alone(request, self.cost)
        draft, self.draft, self.drafted = self.draft, None, False
        if draft is None or max_draft <= 0:
            return None
        return draft if draft.parents is not None else draft.truncate(max_draft)

    def update(self, tokens: list, num_proposed: int, num_accepted: int):
        offered, self.offered = self.offered, None
        if offered is not None:  # the chain as if verified alone, for the calibration
            start, chain, confidences = offered
            agreed = common_prefix_len(chain, tokens[start:])
            judged = min(agreed + 1, len(chain), len(tokens) - start)
            self.drafter.calibration.record(confidences[:judged], agreed)
            if num_proposed and self.offered_tree:  # a tree: its chain sets the length
                num_proposed, num_accepted = len(chain), agreed
        self.length.record(num_proposed, num_accepted)


class SharedDrafter(Drafter):
    """A model drafting for every row that holds one of its sources, in one call per step. One
    position's time is recorded by its sources' name, so ranks decoding in lockstep agree on it;
    ``draft_cost_prior`` stands for it, as a fraction of a target pass, until timed. ``options``
    are its sources' keyword arguments; ``chunk_size``, positions per call when a row catches up."""

    min_confidence = 0.0  # a row stops drafting once its top probability falls below this
    min_tokens = 1  # the shortest text a row drafts after
    tree_width = 1  # nodes per depth a tree runs from; 1: the chain, other choices as leaves

    def __init__(self, source_class, options: dict, draft_cost_prior: float, chunk_size: int):
        self.source_class, self.options = source_class, options
        self.draft_cost_prior, self.chunk_size = draft_cost_prior, chunk_size
        self.batch_rows = 1  # rows in the target's batch at the last draft
        self.rows = []  # the sources of the rows its cache holds, in cache order
        self.cache = None
        self.calibration = Calibration()  # its top probability against the acceptance measured
        self.loop_cache = None  # a weak reference to the one-row loop's cache (``use_cache``)

    def source(self) -> SharedSource:
        """A source for one row."""
        source = self.source_class(self, **self.options)
        return source

    def use_cache(self, cache):
        self.loop_cache = weakref.ref(cache)  # the loop holds it while it runs

    def draft_cost(self, cost: PassCost) -> float:
        """One draft position as a fraction of the target's plain pass (the prior until timed)."""
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
        """Draft for one row outside a batch; rows of other sources (earlier generations) go."""
        for source in [s for s in self.rows if s is not request.source]:
            self.leave(source)
        cache = self.loop_cache() if self.loop_cache is not None else None
        self.draft_all([request], cost, 1, cache)

    def draft_all(self, requests: list, cost: PassCost, batch_rows: int, cache=None):
        """Draft for every row in ``requests``; ``cache`` is the target's (None: one row alone)."""
        self.batch_rows = batch_rows
        for source in self.rows:  # last step's untaken drafts are stale
            source.draft = None
        self._join(requests)
        request_tokens = {id(request.source): request.tokens for request in requests}
        lengths = {}
        for source, tokens, max_draft, *_ in requests:
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
        nodes = {id(request.source): request.max_nodes for request in requests}
        # Under ``auto`` a sampled row drafts a chain from q, accepted with 1 - TV(p, q), where a
        # tree's point masses get only p(x) each. A count asked for gives a tree at any temperature.
        trees = [
            nodes.get(id(source)) is not None
            and (source.sampling.temp == 0 or nodes[id(source)] > 0)
            for source in self.rows
        ]
        texts = [request_tokens.get(id(source), []) for source in self.rows]
        drafts, positions = self._chain(last, lengths, trees, texts)
        cost.record_draft(f"{self.source_class.name} position", cost.clock() - tic, positions)
        for source, (tokens, rows, confidences, growth) in zip(self.rows, drafts):
            if not tokens:
                continue
            source.offered = (len(request_tokens[id(source)]), tokens, confidences)
            source.offered_tree = growth is not None
            if growth is not None:
                source.draft = self._tree(source, tokens, growth, nodes)
            else:
                source.draft = Draft(tokens, None if source.sampling.temp == 0 else self._q(rows))

    def _tree(self, source, chain: list, growth: TreeGrowth, nodes: dict):
        """A row's tree of the best nodes drawn; when adaptive, only those whose chance pays for
        their share of the pass (their drafting is already paid for)."""
        max_nodes = nodes[id(source)] or min(2 * source.length.max_draft, MAX_TREE_NODES)
        threshold = source.cost.token_cost(self.batch_rows) if source.length.enabled else None
        draft, expected = growth.tree(max_nodes, threshold)
        if not draft.tokens:  # nothing pays but the chain's first token, drafted to probe
            draft = Draft(chain[:1])
        if is_chain(draft.parents):  # a chain verifies without a tree's mask
            draft.parents = None
        draft.expected_speedup = expected / source.cost.relative(
            1 + len(draft.tokens), self.batch_rows
        )
        return draft

    def _join(self, requests: list):
        """Before drafting (untimed): rows asking for the first time may join here."""

    def _prepare(self, requests: list, cache) -> tuple:
        """New rows join and each row's cache goes back to what it shares with its text. Returns
        the positions each row feeds now, and ``feed(start, counts, width)``: the model's output
        (R, width, ...) for each row's positions ``[start, start + counts[r])``, right-padded."""
        raise NotImplementedError

    def _draw(
        self,
        last: mx.array,
        sources: list,
        trees: Optional[list] = None,
        contexts: Optional[list] = None,
    ) -> tuple:
        """``draw_rows`` from each cache row's last output (R, ...)."""
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
        """Feed each row its ``counts[r]`` positions in chunks; returns each row's last output."""
        last = None
        for start in range(0, max(counts), self.chunk_size):
            chunk = [min(max(n - start, 0), self.chunk_size) for n in counts]
            width = max(chunk)
            out = feed(start, chunk, width)
            self.cache.rewind([width - n for n in chunk])
            step = out[mx.arange(len(chunk)), mx.array([max(n - 1, 0) for n in chunk], mx.int32)]
            has = mx.array([n > 0 for n in chunk], mx.bool_)[:, None]
            last = step if last is None else mx.where(has, step, last)
        return last

    def _chain(self, last: mx.array, lengths: list, trees: list, texts: list) -> tuple:
        """Draft up to ``lengths[r]`` tokens per row, one call per position for all rows; returns
        per row ``(tokens, q rows, confidences, growth)`` and the positions drafted. A tree row's
        frontier runs on copies of its cache rows (rows ``R`` on); every cache is rolled back."""
        rows = len(self.rows)
        drafts = [([], [], []) for _ in self.rows]
        growths = [TreeGrowth(self.tree_width, self.calibration) if t else None for t in trees]
        alive, path = [n > 0 for n in lengths], [1.0] * rows
        stops = [self._path_stop(s) if n else 0.0 for s, n in zip(self.rows, lengths)]
        processed = any(source.processors and source.sampling.temp > 0 for source in self.rows)
        chain_nodes = [-1] * rows  # per tree row, its chain's last node (-1: none yet)
        frontier, fed = [], 0  # (row, node, cache row): the tree nodes run from beside chains
        try:
            for position in range(max(lengths)):
                owners = list(range(rows)) + [row for row, _, _ in frontier]
                contexts = None
                if processed:
                    contexts = [list(texts[row]) + drafts[row][0] for row in owners]
                indices, tokens, confidences, probs, tops = self._draw_for(
                    last, owners, trees, contexts
                )
                for row, (drafted, rows_q, drafted_confidences) in enumerate(drafts):
                    # The top probability, not the drawn token's: whether to draft position i must
                    # not depend on the token drawn there, or sampling would no longer be exact.
                    path[row] *= self.calibration(confidences[row])
                    low = confidences[row] < self.min_confidence or path[row] < stops[row]
                    if position >= lengths[row] or (position and low):
                        alive[row] = False
                    if alive[row]:
                        drafted.append(tokens[row])
                        rows_q.append(probs[row])
                        drafted_confidences.append(confidences[row])
                room = [position + 1 < n for n in lengths]
                drawn = self._grow(growths, chain_nodes, alive, frontier, tops, confidences)
                frontier = self._frontier(growths, drawn, chain_nodes, alive, stops, room)
                if position + 1 == max(lengths) or not (any(alive) or frontier):
                    break
                last, indices = self._fork(last, indices[:rows], growths, frontier)
                last = self._next(last, indices)
                fed += 1
        finally:  # the copies go, and every row drops what it was fed
            self.cache.rewind([fed] * self.cache.rows)
            if self.cache.rows > rows:
                self.cache.filter(list(range(rows)))
        return [(*draft, growth) for draft, growth in zip(drafts, growths)], fed + 1

    def _draw_for(self, last: mx.array, owners: list, trees: list, contexts) -> tuple:
        """``_draw`` for cache rows drafting for rows ``owners``, with the values on the host
        (tops as ``(index, token, q)``)."""
        sources = [self.rows[row] for row in owners]
        row_trees = [trees[row] for row in owners] if any(trees) else None
        indices, confidence, probs, top = self._draw(last, sources, row_trees, contexts)
        mx.eval(indices, confidence, top)  # one sync per position: the stops need the values
        tokens, confidences = self._tokens(indices.tolist()), confidence.tolist()
        if top is not None:
            top_indices, top_q = top[0].tolist(), top[1].tolist()
            top = [list(zip(i, self._tokens(i), q)) for i, q in zip(top_indices, top_q)]
        return indices, tokens, confidences, probs, top

    def _grow(self, growths, chain_nodes, alive, frontier, tops, confidences) -> list:
        """Each tree row's nodes drawn now, as ``(row, node, cache row)``: the children of its
        chain's last node and of its frontier's nodes."""
        drawn = []
        for row, growth in enumerate(growths):
            if growth is not None and alive[row]:
                children = growth.add_children(chain_nodes[row], tops[row], confidences[row])
                chain_nodes[row] = children[0]
                drawn += [(row, child, row) for child in children]
        for cache_row, (row, node, _) in enumerate(frontier, start=len(growths)):
            children = growths[row].add_children(node, tops[cache_row], confidences[cache_row])
            drawn += [(row, child, cache_row) for child in children]
        return drawn

    def _frontier(self, growths, drawn, chain_nodes, alive, stops, room) -> list:
        """The nodes ``drawn`` that each tree row with ``room`` runs from next beside its chain."""
        frontier = []
        for row, growth in enumerate(growths):
            if growth is None or not room[row]:
                continue
            cache_rows = {node: cache_row for owner, node, cache_row in drawn if owner == row}
            chain = chain_nodes[row] if alive[row] else None
            nodes = growth.frontier(list(cache_rows), chain, stops[row])
            frontier += [(row, node, cache_rows[node]) for node in nodes]
        return frontier

    def _fork(self, last: mx.array, indices: mx.array, growths: list, frontier: list) -> tuple:
        """``(last, indices)`` for the next call, each ``frontier`` node on a copy of the cache row
        it was drawn from."""
        rows = len(growths)
        take = list(range(rows)) + [cache_row for _, _, cache_row in frontier]
        if take != list(range(self.cache.rows)):
            self.cache.filter(take)  # a repeated row is a copy
            last = last[mx.array(take, mx.int32)]
        if frontier:
            fed = [growths[row].nodes[node].index for row, node, _ in frontier]
            indices = mx.concatenate([indices, mx.array(fed, indices.dtype)])
        return last, indices
