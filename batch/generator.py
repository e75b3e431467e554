"""Many sequences at once: decoder/step.py's step for many rows, rows joining and leaving.

Each row has its own prompt, draft sources, constraint, sampling settings, ``max_tokens`` and stop
tokens. A step asks every row's sources for a draft (``draft.choose_draft``) and cuts it to what
the row's constraint allows (``constrain.constrain_draft``), chooses one width ``W`` for the batch
(``choose_width``), scores ``[B, W]`` tokens in one forward pass and accepts each row's prefix by
its own rule (``decoder.step.verify_step``, ``decoder.accept``). Each row then drops its own
rejected tokens from the one batch cache (``cache.Cache``: every row keeps its own end, no copy).

    gen = BatchGenerator(model, eos_token_ids=eos_ids_of(tokenizer))
    uids = gen.insert(prompts, draft_sources=[[PromptLookupSource()] for _ in prompts])
    while responses := gen.next():
        for response in responses:  # uid, tokens, their sources, finish_reason
            ...

``insert(..., logprobs=k)`` also gives, per emitted token, the target's log-probability of it and
its k most likely tokens (``RowResponse.logprobs``, ``batch.logprobs``), read from the pass that
verified it: a token has the same logprobs whether a source drafted it or the target chose it.

Nothing here holds a thread or a lock: a server calls ``insert``, ``next`` and ``remove`` from the
one thread that owns the model.
"""

import itertools
import time
from collections import defaultdict
from typing import List, Optional, Sequence, Union

import mlx.core as mx

from batch.logprobs import token_logprobs
from batch.model_probe import probe
from batch.policy import DraftGate, choose_width, prefill_group
from batch.row import BatchRow, RowResponse, new_rows, shared_prompts
from batch.stats import BatchStats
from decoder.cache import check_quantizable
from decoder.draft import DraftRequest
from decoder.pass_cost import PassCost
from decoder.prefill import Prefill, PrefixStore
from decoder.sampling import Sampling
from decoder.step import verify_step
from decoder.tree_choice import TreeChoice
from decoder.tree_pass import enable_trees, max_nodes_for

# Rows whose ends drift further apart than this are rolled back into line (one copy of the cache),
# so that no row attends over many slots that hold nothing of its own.
MAX_RAGGEDNESS = 64


class BatchGenerator:
    """Continuous batching with every draft source and constraint, one row per sequence.

    Args:
        model: an mlx-lm model whose layers take a per-layer cache (Llama-style attention).
        eos_token_ids: a row stops after emitting one of these (``insert`` can override per call).
        prefill_step_size: new prompts are prefilled together in chunks of this many positions.
        prefill_batch_size: at most this many waiting prompts join the batch per ``next()``.
        max_batch: at most this many rows run at once; the others wait their turn (None: no limit).
        max_width: the widest pass (1 + draft tokens); None leaves it to the policy.
        pass_cost: the verification-cost model; the generator times every ``[B, W]`` pass into it
            and the rows' sources read it (keep one across batches to keep what it measured).
        interleave_prefill: while rows are decoding, prefill joining prompts one chunk per
            ``next()`` (a long prompt does not stall the running rows); else all at once.
        keep_caches: give each finished row's KV entries in its last response (``cache``).
        drafters: the models that draft for many rows at once (``decoder.draft.Drafter``:
            ``DraftModel``, ``HeadDrafter``, ``MTPDrafter``), whose ``source()`` rows hold: each
            drafts for all its rows in one call per step. A row's source's drafter not given here
            is adopted when the row is inserted (``DraftSource.drafter``).
        tree_nodes: rows draft trees of at most this many nodes, ``"auto"`` as many as pay, 0
            chains; the generator calls ``decoder.enable_trees(model)`` (a model it refuses
            drafts chains).
        prompt_store: a ``decoder.prefill.PrefixStore`` (``prompt_store.PromptStore``, on disk):
            a row starts from the longest prefix it or ``insert``'s ``prompt_cache`` holds, and
            the blocks its prefill completes are stored.
        kv_bits, kv_group_size: keep the rows' keys and values quantized (``make_cache``).
    """

    def __init__(
        self,
        model,
        *,
        eos_token_ids: Sequence[int] = (),
        prefill_step_size: int = 512,
        prefill_batch_size: int = 8,
        max_batch: Optional[int] = None,
        max_width: Optional[int] = None,
        pass_cost: Optional[PassCost] = None,
        interleave_prefill: bool = False,
        keep_caches: bool = False,
        drafters: Sequence = (),
        tree_nodes: Union[int, str] = 0,
        prompt_store: Optional[PrefixStore] = None,
        kv_bits: Optional[int] = None,
        kv_group_size: int = 64,
    ):
        self.model, self.drafters = model, list(drafters)
        if tree_nodes:  # the model's rope modules take a tree's positions (once, in place)
            enable_trees(model)
        self.max_nodes = max_nodes_for(model, tree_nodes)
        # "auto": trees while they emit more per second than chains here, chosen apart for each
        # batch size class (1, 2-3, 4-7, 8-15 ... rows): where a draft token costs about as much as
        # a row (a CPU), trees can pay for a few rows and not for many
        self.trees = defaultdict(TreeChoice) if self.max_nodes == 0 else None
        self.eos_token_ids = set(eos_token_ids)
        self.prefill_step_size, self.prefill_batch_size = prefill_step_size, prefill_batch_size
        self.max_batch = max_batch
        self.max_width = max_width
        self.interleave_prefill, self.keep_caches = interleave_prefill, keep_caches
        self.prompt_store = prompt_store
        self.quantized = dict(kv_bits=kv_bits, kv_group_size=kv_group_size)
        if kv_bits is not None:  # refused in one line before any prompt comes
            check_quantizable(model, kv_group_size)
        self.prefilling = None  # (rows, Prefill) while joining prompts are prefilled chunk by chunk
        self.removed = set()  # uids removed while prefilling
        self.cost = pass_cost if pass_cost is not None else PassCost()
        self.gate = DraftGate()
        self.stats = BatchStats()
        self.rows: List[BatchRow] = []
        # each row's row in the cache; the others hold rows that have left
        self.slots: List[int] = []
        self.waiting: List[BatchRow] = []
        self.cache = None  # a cache.Cache while rows run
        # what the model needs of the cache (batch.model_probe.probe), asked at the first join
        self.mask_dims = None
        self.uids = itertools.count()  # a row's uid, taken when the row is made

    def insert(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        draft_sources=None,
        constraint=None,
        sampling=Sampling(),
        logits_processors=None,
        sampler=None,
        max_tokens=256,
        eos_token_ids=None,
        prompt_cache=None,
        logprobs=None,
        seed=None,
    ) -> List[int]:
        """Queue prompts (token id lists); returns their uids. Each option is one value for every
        prompt or a list with one per prompt; ``draft_sources`` is a list of fresh sources per
        prompt and ``constraint`` one object per prompt: rows never share a stateful object.
        ``prompt_cache`` is per prompt None or a ``CachedPrefix`` of its first n < len(prompt)
        tokens (a finished row's ``RowResponse.cache``, cut to n), so only the rest is prefilled.
        ``logprobs`` is None (the default: nothing extra is computed) or k >= 0: each response then
        has a ``TokenLogprobs`` per token, with the k most likely tokens at its position.
        ``sampling`` holds mlx-lm's ``make_sampler``'s settings (``decoder.Sampling``);
        ``logits_processors`` is None or one list of mlx-lm's processors per prompt, applied at
        each of the row's positions. ``seed``:
        None (MLX's global stream) or an integer: the row's draws come from its own
        ``mx.random.key(seed)``, so a row samples what it samples alone (``decoder.row.Row``)."""
        rows = new_rows(
            prompts,
            self.rows + self.waiting,
            self.uids,
            self.eos_token_ids if eos_token_ids is None else set(eos_token_ids),
            self.max_nodes,
            draft_sources,
            logits_processors,
            prompt_cache,
            (constraint, sampling, sampler, max_tokens, logprobs, seed),
        )
        for source in [s for row in rows for s in row.sources if s.drafter is not None]:
            if source.drafter not in self.drafters:  # it drafts for all its rows at once
                self.drafters.append(source.drafter)
        self.waiting += rows
        return [row.uid for row in rows]

    def remove(self, uids: Sequence[int]):
        """Drop rows (running or waiting); the others go on untouched."""
        uids = set(uids)
        self.waiting = [row for row in self.waiting if row.uid not in uids]
        if self.prefilling is not None:
            self.removed |= uids & {row.uid for row in self.prefilling[0]}
        self._drop([i for i, row in enumerate(self.rows) if row.uid in uids])

    def close(self):
        """Drop every row, running, waiting or prefilling: the drafters let go of their rows (a
        server replacing a generator whose step failed)."""
        self.waiting, self.prefilling, self.removed = [], None, set()
        self._drop(list(range(len(self.rows))))

    def _drop(self, indices: Sequence[int]):
        """Rows leave at once, but their cache rows stay, unused, until half the cache is unused or
        rows join: a leaving row costs no copy of the cache. An unused row still costs its share of
        each pass, little while the batch keeps its size, and the copy is saved (measured in
        benchmarks/results/batch.md, "Design measurements")."""
        if not indices:
            return
        for index in indices:
            for drafter in self.drafters:
                for source in filter(drafter.owns, self.rows[index].sources):
                    drafter.leave(source)
        keep = [i for i in range(len(self.rows)) if i not in set(indices)]
        self.rows, self.slots = [self.rows[i] for i in keep], [self.slots[i] for i in keep]
        if not keep:
            self.cache, self.slots = None, []
        elif 2 * len(self.slots) <= self.cache.rows:
            self._compact()

    def _compact(self):
        """Drop the cache rows no running row uses (one copy)."""
        if self.slots != list(range(self.cache.rows)):
            self.cache.filter(self.slots)
            mx.eval(self.cache.arrays())  # copied now, not inside the next timed pass
            self.slots = list(range(len(self.rows)))

    def __len__(self) -> int:
        return (
            len(self.rows) + len(self.waiting) + (len(self.prefilling[0]) if self.prefilling else 0)
        )

    def _join(self, responses: list):
        """Prefill up to ``prefill_batch_size`` waiting prompts of similar lengths
        (``prefill_group``) as one batch and merge them in (one chunk per call with
        ``interleave_prefill`` while other rows decode)."""
        if self.prefilling is None:
            if self.waiting and self.mask_dims is None and self.max_batch == 1:
                self.mask_dims = 4  # one row is never padded (and some caches hold one row only)
            elif self.waiting and self.mask_dims is None:
                self.mask_dims, masks_padding = probe(self.model)
                if not masks_padding:  # rows of one pass would differ in length: one row at a time
                    self.max_batch = self.prefill_batch_size = 1
            joining, count = [], self.prefill_batch_size
            if self.max_batch is not None:
                count = max(0, min(count, self.max_batch - len(self.rows)))
            group = set(prefill_group([len(row.tokens) for row in self.waiting[:count]]))
            admitted = [row for i, row in enumerate(self.waiting) if i in group]
            self.waiting = [row for i, row in enumerate(self.waiting) if i not in group]
            for row in admitted:
                try:
                    row.reset(self.cost)
                    joining.append(row)
                except Exception as error:  # noqa: BLE001 - a row's own objects failed; the batch goes on
                    responses.append(row.failed(error))
            if not joining:
                return
            if self.prompt_store is not None:
                self._restore(joining)
            firsts, copies = shared_prompts(joining)
            prefill = Prefill(
                self.model,
                [joining[i].tokens[:-1] for i in firsts],
                self.prefill_step_size,
                [joining[i].prompt_cache for i in firsts],
                self.mask_dims,
                store=self.prompt_store,
                **self.quantized,
            )
            self.stats.prefilled_tokens += sum(len(tokens) for tokens in prefill.pending)
            for row in joining:
                if row.prompt_cache is not None:
                    row.stats.prompt_cache_tokens = row.prompt_cache.length
                row.prompt_cache, row.cached = None, len(row.tokens) - 1
            self.prefilling = (joining, prefill, copies)
        joining, prefill, copies = self.prefilling
        tic = time.perf_counter()
        done = prefill.step()
        while not done and not (self.interleave_prefill and self.rows):
            done = prefill.step()
        self.stats.prompt_time += time.perf_counter() - tic
        if not done:
            return
        self.prefilling = None
        self.stats.prompt_tokens += sum(len(row.tokens) for row in joining)
        removed, self.removed = self.removed, set()
        # not removed while prefilling
        keep = [i for i, row in enumerate(joining) if row.uid not in removed]
        if not keep:
            return
        # each row's cache row: a prompt prefilled once is copied to every row that shares it
        rows = [copies[i] for i in keep]
        joining = [joining[i] for i in keep]
        if rows != list(range(prefill.cache.rows)):
            prefill.cache.filter(rows)
        if self.cache is None:
            self.cache = prefill.cache
        else:
            self._compact()  # the join copies the cache anyway
            self.cache.extend(prefill.cache)
        mx.eval(self.cache.arrays())  # copied now, not inside the next timed pass
        self.slots += range(len(self.rows), len(self.rows) + len(joining))
        self.rows += joining
        self.gate.reset()  # new rows' sources are asked at once

    def _restore(self, rows: list):
        """Each row starts from the store's prefix of its prompt where that is longer than the
        ``prompt_cache`` it was given."""
        for row in rows:
            held = 0 if row.prompt_cache is None else row.prompt_cache.length
            restored = self.prompt_store.lookup(row.tokens, held)
            if restored is not None:
                row.prompt_cache = restored

    def _draft_with_models(self, responses: list, trees: bool):
        """Each shared drafter (``drafters``) drafts for all its rows at once, before the rows
        choose, told each row's slot in the cache; ``trees`` False: chains this step."""
        for drafter in self.drafters:
            requests = [
                DraftRequest(source, row.tokens, row.max_draft, slot, row.nodes_this_step(trees))
                for row, slot in zip(self.rows, self.slots)
                for source in filter(drafter.owns, row.sources)
            ]
            if not requests:
                continue
            try:
                drafter.draft_all(requests, self.cost, len(self.rows), self.cache)
            except Exception as error:  # noqa: BLE001 - the model's rows fail, the others go on
                failing = {id(request.source) for request in requests}
                indices = [
                    i
                    for i, row in enumerate(self.rows)
                    if any(id(s) in failing for s in row.sources)
                ]
                responses += [self.rows[i].failed(error) for i in indices]
                self._drop(indices)

    def next(self) -> List[RowResponse]:
        """One step: admit waiting prompts, then one ``[B, W]`` pass for every running row. Returns
        a response for each row that emitted tokens or finished; an empty list once nothing is
        left."""
        responses = []
        self._join(responses)
        if not self.rows:
            return responses
        tic, started = time.perf_counter(), self.cost.clock()
        asked = self.gate.ask() and any(row.sources for row in self.rows)
        choice = None if self.trees is None else self.trees[len(self.rows).bit_length()]
        trees = choice is None or choice.use_trees()
        if asked:
            self._draft_with_models(responses, trees)
        plans, failed = [], []
        for index, row in enumerate(self.rows):
            try:
                # Drafting is not timed here: a shared drafter drafted for all its rows already
                # (``_draft_with_models``), and a lookup's propose is not a model call.
                sources = self.gate.sources(row.sources, asked)
                plans.append(row.plan(sources=sources, trees=trees))
            except Exception as error:  # noqa: BLE001
                responses.append(row.failed(error))
                failed.append(index)
        self._drop(failed)
        if not self.rows:
            return responses
        width = choose_width(
            [len(plan.draft.tokens) for plan in plans],
            [row.expects(plan) for row, plan in zip(self.rows, plans)],
            self.cost,
            self.max_width,
            self.cache.rows,
        )
        if asked:
            self.gate.record(width)
        # the choice is timed on the pass cost's clock, over steps with a row it decides for
        timed = choice is not None and asked and any(row.max_nodes == 0 for row in self.rows)
        rows, cache_rows = len(self.rows), self.cache.rows
        emitted = self._verify(width, plans, responses)
        self.stats.decode_time += time.perf_counter() - tic
        plain = self.cost.seconds(1, cache_rows)  # None while no pass was timed
        if timed and plain:  # compared as speedups: the batch size changes as rows join and leave
            seconds = self.cost.agreed(self.cost.clock() - started)
            choice.record(trees, emitted, seconds, plain / rows)
        self.stats.generation_tokens += emitted
        return responses

    def _verify(self, width: int, plans: list, responses: list) -> int:
        """One step for every row (``decoder.step.verify_step``): row b feeds its pending tokens
        and its draft cut to ``width - 1``, accepts by its own rules and keeps what it accepts.
        Returns how many tokens the rows emitted."""
        step = verify_step(self.model, self.cache, self.rows, plans, width, self.cost, self.slots)
        self.stats.passes += 1
        self.stats.widths[step.pass_width] += 1
        self.stats.row_passes += len(self.rows)
        logprobs = token_logprobs(self.rows, step.drafts, step.results, step.logits)
        return self._emit(plans, step.drafts, step.results, logprobs, responses)

    def _emit(
        self, plans: list, drafts: list, results: list, logprobs: list, responses: list
    ) -> int:
        """Each row emits what it accepted (``Row.emit``) in a response; finished rows leave, and
        rows whose ends drift apart are rolled back into line."""
        finished, emitted_total, cache = [], 0, self.cache
        for index, (row, draft, plan, result) in enumerate(zip(self.rows, drafts, plans, results)):
            try:
                if isinstance(result, Exception):
                    raise result
                if plan.source is not None:  # the width policy learns from every offered draft
                    row.acceptance.record(
                        plan.source.name,
                        plan.draft.first_branch(),
                        draft.path_tokens(row.path[: result[0]]) + [result[1]],
                    )
                tokens, sources = row.emit(plan, draft, *result)
                response = RowResponse(
                    row.uid,
                    tokens,
                    sources,
                    row.finish_reason,
                    stats=row.stats if row.finish_reason else None,
                )
                if logprobs[index] is not None:  # emit may have cut the tokens at EOS or max_tokens
                    response.logprobs = logprobs[index][: len(response.tokens)]
                emitted_total += len(response.tokens)
            except Exception as error:  # noqa: BLE001
                response = row.failed(error)
            responses.append(response)
            if response.finish_reason is not None:
                finished.append(index)
                if self.keep_caches and response.finish_reason != "error":
                    response.cache = cache.extract(self.slots[index], row.cached)
        self._drop(finished)
        ends = cache.ends if self.cache is not None else []
        if self.rows and max(ends) - min(ends) > MAX_RAGGEDNESS:
            cache.realign()
            mx.eval(cache.arrays())
        return emitted_total
