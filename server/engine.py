"""One generation at a time on a worker thread, fed by a bounded first-in-first-out queue.

MLX is not thread-safe for concurrent generation on one model, so every MLX call happens on the
worker; the HTTP side only tokenizes and waits for events. A request that arrives with the queue
full is refused at once (HTTP 503) rather than left waiting. A cancelled request (the client left)
is dropped from the queue, or stopped within one decoding step if it is running.

The KV cache of the last generation is kept with the tokens it holds. A new request that shares a
prefix with them (the same conversation one turn later) prefills only what follows that prefix.
"""

import asyncio
import queue
import sys
import threading
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.utils import common_prefix_len

from cost import PassCost
from decoder import ConstraintError, DecodingStats, TextStream, eos_ids_of, generate_step
from server.protocol import ApiError, GenerationRequest, invalid
from sources import grammar_constraint, regex_constraint

MAX_CACHED_CONSTRAINTS = 32  # token indexes are ~1 MB each; a client reuses few schemas


@dataclass
class Outcome:
    """What a finished generation reports after its last text event."""

    text: str
    finish_reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV entries came from the previous request
    stats: DecodingStats = field(default_factory=DecodingStats)


class Job:
    """A queued request and the events its handler awaits: ("start", None), ("text", str), then
    ("done", Outcome) or ("error", ApiError)."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.loop = loop
        self.events = asyncio.Queue()
        self.cancelled = threading.Event()

    def send(self, kind: str, payload=None):
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


class StopText:
    """Holds back text that may be the start of a stop string, and cuts the text at one."""

    def __init__(self, stop: list):
        self.stop = stop
        self.held = ""

    def add(self, piece: str) -> tuple:
        """``(text safe to send, whether a stop string was found)``."""
        self.held += piece
        found = [i for i in (self.held.find(s) for s in self.stop) if i >= 0]
        if found:
            text, self.held = self.held[: min(found)], ""
            return text, True
        keep = max((k for s in self.stop for k in range(1, len(s)) if self.held.endswith(s[:k])), default=0)
        text, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        return text, False

    def flush(self) -> str:
        text, self.held = self.held, ""
        return text


class Engine:
    """The model, its draft sources and the prompt cache, driven by one worker thread.

    Args:
        model: what the loop runs (a ``HiddenStateTap`` when a draft head is on).
        draft_sources: reused for every request (the loop resets them with each request's
            ``temp``/``top_p``, so their drafts come from the distribution they report).
        reuse_cache: False when a source needs the whole prompt run through the model (a draft head).
        max_queue: requests waiting behind the running one before new ones get HTTP 503.
    """

    def __init__(self, model, tokenizer, vocab_size: int, draft_sources=(), reuse_cache: bool = True,
                 max_queue: int = 8, cache_dir=None):
        self.model, self.tokenizer, self.vocab_size = model, tokenizer, vocab_size
        self.draft_sources = list(draft_sources)
        self.reuse_cache = reuse_cache
        self.cache_dir = cache_dir
        self.eos = eos_ids_of(tokenizer)
        self.jobs = queue.Queue(maxsize=max_queue)
        self.constraints = OrderedDict()  # (kind, pattern) -> (constraint, forced-text source)
        self.cache, self.cache_tokens = make_prompt_cache(model), []
        self.pass_cost = PassCost()  # kept across requests: the measured cost of passes here
        self.worker = threading.Thread(target=self._work, name="generation", daemon=True)
        self.worker.start()

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> Job:
        job = Job(request, loop)
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise ApiError(503, "the server is busy: too many requests are queued; retry shortly",
                           code="server_busy", headers={"Retry-After": "1"}) from None
        return job

    def _work(self):
        while True:
            job = self.jobs.get()
            if job.cancelled.is_set():
                continue  # the client left while the request was queued
            try:
                job.send("done", self._generate(job))
            except ApiError as error:
                job.send("error", error)
            except ConstraintError as error:
                job.send("error", ApiError(500, f"constrained decoding failed: {error}"))
            except Exception as error:  # a fault in one request must not stop the worker
                traceback.print_exc(file=sys.stderr)
                self.cache, self.cache_tokens = make_prompt_cache(self.model), []  # its state is unknown
                job.send("error", ApiError(500, f"generation failed: {type(error).__name__}: {error}"))

    def _constraint(self, request: GenerationRequest):
        """The (constraint, forced-text source) for the request's regex or grammar; built once each."""
        key = ("regex", request.regex) if request.regex is not None else ("grammar", request.grammar)
        if key[1] is None:
            return None, None
        if key not in self.constraints:
            self.constraints[key] = self._build_constraint(*key)
            if len(self.constraints) > MAX_CACHED_CONSTRAINTS:
                self.constraints.popitem(last=False)
        self.constraints.move_to_end(key)
        return self.constraints[key]

    def _build_constraint(self, kind: str, pattern: str):
        """Built as main.py builds --regex and --grammar (sources.py)."""
        if kind == "grammar":
            try:
                from constrained.grammar import GrammarError, compile_grammar
            except ImportError:
                raise invalid("guided_grammar needs constrained/grammar.py and llguidance", "guided_grammar") from None
            try:
                return grammar_constraint(compile_grammar(pattern), self.tokenizer, self.vocab_size)
            except GrammarError as error:
                raise invalid(f"the grammar is not supported: {error}", "guided_grammar") from None
        from constrained import RegexError

        try:
            return regex_constraint(pattern, self.tokenizer, self.vocab_size, self.cache_dir)
        except RegexError as error:
            raise invalid(f"the regex (or the schema's regex) is not supported: {error}", "guided_regex") from None

    def _reusable_cache(self, prompt: list) -> list:
        """The kept cache trimmed to its longest common prefix with ``prompt`` (at least one
        prompt token is left to run, since the loop starts from the last one)."""
        if not self.reuse_cache:
            self.cache, self.cache_tokens = make_prompt_cache(self.model), []
            return self.cache
        common = common_prefix_len(self.cache_tokens, prompt[:-1])
        trim_prompt_cache(self.cache, len(self.cache_tokens) - common)
        del self.cache_tokens[common:]
        return self.cache

    def _keep_cache(self, tokens: list):
        """Record what the cache holds after a generation: a prefix of ``tokens`` (prompt + output).
        It may hold more, when accepted draft tokens past a stop were not emitted; those are cut."""
        held = self.cache[0].offset
        keep = min(held, len(tokens))
        trim_prompt_cache(self.cache, held - keep)
        self.cache_tokens = tokens[:keep]

    def _generate(self, job: Job) -> Outcome:
        request = job.request
        constraint, forced = self._constraint(request)
        sources = ([forced] if forced is not None else []) + self.draft_sources
        if request.seed is not None:
            mx.random.seed(request.seed)
        cache = self._reusable_cache(request.prompt)
        outcome = Outcome("", "length", len(request.prompt), 0, len(self.cache_tokens))
        job.send("start")
        text, stopper, generated, pieces = TextStream(self.tokenizer), StopText(request.stop), [], []
        steps = generate_step(request.prompt, self.model, eos_token_ids=self.eos, draft_sources=sources,
                              constraint=constraint, temp=request.temp, top_p=request.top_p,
                              max_tokens=request.max_tokens, stats=outcome.stats, prompt_cache=cache,
                              pass_cost=self.pass_cost)
        try:
            for token, _source in steps:
                generated.append(token)
                if token in self.eos:
                    outcome.finish_reason = "stop"
                    break
                piece, stopped = stopper.add(text.add(token))
                if piece:
                    pieces.append(piece)
                    job.send("text", piece)
                if stopped:
                    outcome.finish_reason = "stop"
                    break
                if job.cancelled.is_set():  # checked between tokens: stops within one step
                    outcome.finish_reason = "cancelled"
                    break
        finally:
            steps.close()
            self._keep_cache(request.prompt + generated)
        # Text held back for a stop string that never came is output after all.
        if outcome.finish_reason != "cancelled" and (rest := stopper.flush()):
            pieces.append(rest)
            job.send("text", rest)
        outcome.text, outcome.completion_tokens = "".join(pieces), len(generated)
        return outcome
