"""Continuous batching on one worker thread, fed by a bounded first-in-first-out queue, for all
three APIs (chat completions, Responses, Messages): their requests are the same jobs, decoded in one
batch.

MLX is not thread-safe for concurrent generation on one model, so every MLX call happens on the
worker. The HTTP side tokenizes, builds each request's constraint (``constraint_for``, in
server/constraints.py: compiling a new schema takes long enough that, on the worker, it would stall
every running stream) and waits for events. Up to ``max_batch`` requests decode together in one
``batch.BatchGenerator``; beyond that they wait in the queue, and a request that arrives with the
queue full is refused at once (HTTP 503). Each step the worker admits waiting requests (those that
wait together are prefilled as one batch, a chunk per step while others decode), runs one step,
and streams each row's new text. Finished, cancelled and disconnected rows leave at once.

Finished rows' caches are kept in a least-recently-used prompt cache bounded in bytes; a request
that extends an earlier conversation prefills only what follows the longest cached prefix (for a
model with recurrent layers, a prefix the request extends whole).
Under ``mlx.launch`` with a sharded model, rank 0's engine serves and the other ranks' engines
follow it step by step (``ranks``: server/ranks.py). Every draft source drafts per row, a draft head
and MTP layers too. A model whose cache a batch cannot hold (llama4's chunked attention) decodes one
request at a time in the same loop.

A request with ``logprobs`` gets, per generated token (EOS aside), the target's log-probability of
it and its most likely alternatives, from the verify pass that scored the token
(``batch.TokenLogprobs``: log-softmax at temperature 1 before top_p, as mlx_lm.server reports; under
a constraint, of the masked distribution, so forbidden tokens never appear among the top ones). The
token that completes a stop string is reported, the ones after it are not.

Every failed request leaves a line in the log, with its id and API (server/failures.py).
"""

import asyncio
import queue
import threading
import time
from dataclasses import replace
from typing import Optional, Sequence

import mlx.core as mx

from batch import BatchGenerator, RowResponse
from batch.row import trace_of
from decoder.draft import ConstraintError
from decoder.pass_cost import PassCost
from decoder.text import eos_ids_of
from server.constraints import RequestConstraints
from server.failures import FailureLog, log
from server.job import Job, Reply
from server.logprob_names import TokenLogprobNames
from server.prompt_cache import PromptCache
from server.ranks import OneProcess, exit_after_answering
from server.request import ApiError, GenerationRequest


class Engine:
    """The model, a factory of per-row draft sources and the prompt cache, driven by one worker
    thread.

    Args:
        make_sources: returns fresh draft sources for one request (``cli.sources.row_sources``).
        keep_caches: keep finished requests' caches for later prompts that extend them
            (``PromptCache``).
        max_batch: requests decoded together; max_queue: requests waiting beyond them before HTTP
            503.
        pass_cost: the timings the width policy reads (``PassCost``); tests pass a fixed clock.
        drafters: the models whose sources ``make_sources`` gives (``BatchGenerator``'s).
        tree_nodes: the rows' draft trees (``BatchGenerator``'s; 0: chains).
        prompt_store: the prompt cache's disk tier under ``PromptCache`` (``PromptStore``): a
            request starts from the longer prefix of the two, and finished rows are stored in
            both.
        kv_bits, kv_group_size: the rows' keys and values kept quantized (``make_cache``).
        ranks: ``server.ranks.Lockstep`` when the model is sharded over several ranks: rank 0's
            engine serves and the others ``follow`` it; by default one process serves alone.
    """

    def __init__(
        self,
        model,
        tokenizer,
        vocab_size: int,
        make_sources=list,
        max_batch: int = 8,
        max_queue: int = 8,
        cache_dir=None,
        prompt_cache_bytes: int = 2**30,
        prefill_step_size: int = 256,
        pass_cost: Optional[PassCost] = None,
        keep_caches: bool = True,
        drafters: Sequence = (),
        ranks=None,
        tree_nodes=0,
        prompt_store=None,
        kv_bits=None,
        kv_group_size=64,
    ):
        self.model, self.tokenizer, self.vocab_size = model, tokenizer, vocab_size
        self.drafters, self.tree_nodes = list(drafters), tree_nodes
        self.make_sources, self.keep_caches = make_sources, keep_caches
        self.max_batch = max_batch
        self.ranks = ranks if ranks is not None else OneProcess()
        self.eos = eos_ids_of(tokenizer)
        self.jobs = queue.Queue()
        self.queueing = threading.Lock()  # held while a group of jobs is queued
        # A place for each request decoding or waiting: refused only when rows and queue are all
        # taken.
        self.places = threading.BoundedSemaphore(max_batch + max_queue)
        self.constraints = RequestConstraints(tokenizer, vocab_size, cache_dir)
        self.failures = FailureLog()
        self.prompt_cache = PromptCache(prompt_cache_bytes, self.ranks.weigh)
        self.prompt_store = prompt_store
        self.quantized = dict(kv_bits=kv_bits, kv_group_size=kv_group_size)
        self.pass_cost = pass_cost if pass_cost is not None else PassCost()
        self.prefill_step_size = prefill_step_size
        self.generator = self._new_generator()
        self.replies = {}  # uid -> Reply, for every running job
        self.joining = []  # jobs taken from the queue for the step being prepared
        self.step_failed = False  # the last step raised (sharded: every rank's must agree)
        self.describe = TokenLogprobNames(tokenizer, vocab_size)  # logprobs in OpenAI's terms
        if self.ranks.rank == 0:
            self.ranks.watch(self._lost)
            self.worker = threading.Thread(target=self._work, name="generation", daemon=True)
            self.worker.start()

    def cache_stats(self) -> dict:
        """The prompt cache's tiers: entries, bytes, hits and misses (GET /v1/cache)."""
        disk = None if self.prompt_store is None else self.prompt_store.stats()
        return {"memory": self.prompt_cache.stats(), "disk": disk}

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self.model,
            eos_token_ids=self.eos,
            prefill_step_size=self.prefill_step_size,
            prefill_batch_size=self.max_batch,
            max_batch=self.max_batch,
            interleave_prefill=True,
            # its timings outlive a failed step
            keep_caches=self.keep_caches,
            pass_cost=self.pass_cost,
            drafters=self.drafters,
            tree_nodes=self.tree_nodes,
            prompt_store=self.prompt_store,
            **self.quantized,
        )

    def submit(
        self,
        request: GenerationRequest,
        loop: asyncio.AbstractEventLoop,
        prepared=None,
        label: Optional[str] = None,
    ) -> Job:
        """Queue ``request`` (HTTP 503 when the queue is full). ``prepared`` is
        ``constraint_for(request)``, built beforehand in a thread of the caller's; None builds it
        here. ``label``: its id and API, as the log names it."""
        return self.submit_together([request], loop, [prepared], [label])[0]

    def submit_together(self, requests: list, loop, prepared: list, labels=None) -> list:
        """Queue ``requests`` as one group (all or none: HTTP 503), which joins the batch in one
        step when rows are free: a request's ``n`` choices (server/choices.py)."""
        labels = labels or [None] * len(requests)
        prepared = [
            ready or self.constraint_for(request) for request, ready in zip(requests, prepared)
        ]
        taken = 0
        while taken < len(requests) and self.places.acquire(blocking=False):
            taken += 1
        if taken < len(requests):
            for _ in range(taken):
                self.places.release()
            raise ApiError(
                503,
                "the server is busy: too many requests are queued; retry shortly",
                code="server_busy",
                headers={"Retry-After": "1"},
            )
        jobs = [
            Job(request, loop, *ready, release=self.places.release, label=label)
            for request, ready, label in zip(requests, prepared, labels)
        ]
        with self.queueing:  # _news takes a group whole
            for job in jobs:
                self.jobs.put(job)
        return jobs

    def close(self):
        """Stop the worker after its step (and, sharded, every other rank's engine)."""
        self.jobs.put(None)

    def follow(self):
        """Run a rank other than 0: the same steps as rank 0's engine, until it stops."""
        self._work()
        self.close_stores()

    def close_stores(self):
        """Write the prompt stores' queued blocks (the target's and a draft model's)."""
        for store in [self.prompt_store] + [drafter.prompt_store for drafter in self.drafters]:
            if store is not None:
                store.close()

    def _work(self):
        try:
            self._steps()
        except Exception as error:  # a peer is gone, or a fault outside a step: serving ends
            lost = self.ranks.lost_peer(error)
            if lost is not None:
                self._lost(lost)
            log.error("the generation loop failed\n%s", trace_of(error).rstrip())
            failed = f"the generation loop failed: {type(error).__name__}: {error}"
            self._end(failed, failed)

    def _steps(self):
        while True:
            news = self._news() if self.ranks.rank == 0 else None
            self.joining = news[0] if news is not None else []  # for _lost, while they are sent
            shared = self.ranks.share(
                None if news is None else self._message(*news), self.step_failed
            )
            self.step_failed = False
            joins, leaves, stop = news if news is not None else self._followed(shared)
            if stop:
                return
            if self.ranks.rank != 0 and shared is None and not len(self.generator):
                time.sleep(self.ranks.idle_wait)  # rank 0 waits as long for requests
            if leaves:
                self.generator.remove(leaves)
                for uid in leaves:
                    self.replies.pop(uid).job.release()
            for job in joins:
                self._guarded(job, lambda: self._start(job))
            if len(self.generator):
                self._step()

    def _news(self) -> Optional[tuple]:
        """What rank 0 heard since the last step: ``(joining jobs, leaving uids, stop)``, or None
        when nothing."""
        waiting, stop = [], False
        if not self.replies and not len(self.generator):  # idle: block, not spin
            try:
                waiting.append(self.jobs.get(timeout=self.ranks.idle_wait))
            except queue.Empty:
                pass
        with self.queueing:
            while len(self.replies) + len(waiting) < self.max_batch and not self.jobs.empty():
                waiting.append(self.jobs.get_nowait())
        if None in waiting:  # close()
            waiting, stop = [job for job in waiting if job is not None], True
        joins = []
        for job in waiting:
            if job.cancelled.is_set():
                job.release()
            else:
                joins.append(job)
        leaves = [uid for uid, reply in self.replies.items() if reply.job.cancelled.is_set()]
        return (joins, leaves, stop) if joins or leaves or stop else None

    @staticmethod
    def _message(joins: list, leaves: list, stop: bool) -> tuple:
        """The news as the other ranks receive it: the requests without what only rank 0 reads."""
        return [replace(job.request, messages=None) for job in joins], leaves, stop

    def _followed(self, shared: Optional[tuple]) -> tuple:
        """Rank 0's news on another rank, with jobs of its own (their constraints compiled
        here)."""
        if shared is None:
            return [], [], False
        requests, leaves, stop = shared
        return (
            [Job(request, None, *self.constraint_for(request)) for request in requests],
            leaves,
            stop,
        )

    def _lost(self, message: str):
        """A peer is gone: every open request gets an error, and this rank exits with one line."""
        self._end(message, f"the sharded model lost a rank: {message}")

    def _end(self, message: str, answer: str):
        """Serving ends: every open request gets a 503 saying ``answer``, and this rank exits with
        ``message`` as its one line."""
        jobs = [reply.job for reply in list(self.replies.values())] + self.joining
        while not self.jobs.empty():
            jobs.append(self.jobs.get_nowait())
        for job in filter(None, jobs):
            self._fail(job, ApiError(503, answer, code="server_stopped"))
        exit_after_answering(message)

    def _fail(self, job: Job, error: ApiError):
        """``job`` ends with ``error``, which the log records first (server/failures.py)."""
        if job.loop is not None:  # another rank's request is logged by rank 0
            self.failures.record(job.label, error)
            error.logged = True
        job.send("error", error)

    def _step(self):
        try:
            responses = self.generator.next()
        except Exception as error:  # a fault in the step: its rows fail, the worker goes on
            if self.ranks.lost_peer(error) is not None:
                raise  # serving ends (_work)
            self.step_failed = True
            message, trace = f"generation failed: {type(error).__name__}: {error}", trace_of(error)
            for reply in self.replies.values():
                self._fail(reply.job, ApiError(500, message, trace=trace))
            try:
                self.generator.close()  # its drafters' rows go with it
            except Exception:  # what the failed step left cannot be released; serving goes on
                log.exception("the failed step's rows could not be released")
            self.replies, self.generator = {}, self._new_generator()
            return
        for response in responses:
            self._respond(response)

    def _guarded(self, job: Job, run):
        try:
            run()
        except ApiError as error:
            self._fail(job, error)
        except ConstraintError as error:
            message = f"constrained decoding failed: {error}"
            self._fail(job, ApiError(500, message, trace=trace_of(error)))
        except Exception as error:  # a fault in one request must not stop the worker
            message = f"generation failed: {type(error).__name__}: {error}"
            self._fail(job, ApiError(500, message, trace=trace_of(error)))

    def _start(self, job: Job):
        request, forced = job.request, job.forced
        if request.seed is not None:  # the row draws from its own seed; a draft model that
            mx.random.seed(request.seed)  # samples, from the global stream
        layers, cached = self.prompt_cache.lookup(request.prompt)
        if self.prompt_store is not None:  # the disk tier, where it holds more
            restored = self.prompt_store.lookup(request.prompt, cached)
            if restored is not None:
                layers, cached = restored, restored.length
        (uid,) = self.generator.insert(
            [request.prompt],
            draft_sources=[([forced] if forced else []) + self.make_sources()],
            constraint=[job.constraint],
            sampling=[request.sampling],
            logits_processors=[request.logits_processors()],
            max_tokens=request.max_tokens,
            prompt_cache=[layers],
            logprobs=[request.logprobs],
            seed=request.seed,
        )
        self.replies[uid] = Reply(job, self.tokenizer, cached)
        job.send("start", cached)

    def _respond(self, response: RowResponse):
        """Send a step's text to its job, and the outcome once the row finishes (or hits a stop
        string)."""
        row = self.replies.get(response.uid)
        if row is None:
            return
        outcome, job = row.outcome, row.job
        row.generated += response.tokens
        stopped = False
        for index, token in enumerate(response.tokens):
            if token in self.eos:
                break
            if row.pending is not None:
                row.pending.append(self.describe(token, response.logprobs[index]))
            piece, stopped = row.stopper.add(row.text.add(token))
            if piece:
                row.send(piece)
            if stopped:
                break
        if response.finish_reason == "error":
            del self.replies[response.uid]
            kind = (
                "constrained decoding"
                if response.error.startswith("ConstraintError")
                else "generation"
            )
            self._fail(job, ApiError(500, f"{kind} failed: {response.error}", trace=response.trace))
            return
        if not stopped and response.finish_reason is None:
            return
        if stopped:
            outcome.finish_reason, outcome.stop_sequence = "stop", row.stopper.found
            if response.finish_reason is None:
                self.generator.remove([response.uid])
        else:
            outcome.finish_reason = response.finish_reason
            # the text of a byte run that never became a character
            piece, _ = row.stopper.add(row.text.finish())
            if piece:
                row.send(piece)
            if rest := row.stopper.flush():  # text held back for a stop string that never came
                row.send(rest)
            outcome.stats = response.stats or outcome.stats
        if row.pending:  # tokens whose text is held back or cut: their logprobs still go out
            row.send("")
        if response.cache is not None:
            self.prompt_cache.add(job.request.prompt + row.generated, response.cache)
            if self.prompt_store is not None:
                self.prompt_store.add(job.request.prompt + row.generated, response.cache)
        del self.replies[response.uid]
        outcome.text, outcome.completion_tokens, outcome.tokens = (
            "".join(row.pieces),
            len(row.generated),
            row.generated,
        )
        job.send("done", outcome)

    def constraint_for(self, request: GenerationRequest) -> tuple:
        """A fresh (constraint, forced-text source) for the request, or (None, None)
        (``RequestConstraints.for_request``): safe from any thread, and meant for the HTTP side."""
        return self.constraints.for_request(request)
