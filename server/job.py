"""A request on the engine (engine.py): the ``Job`` its handler awaits events from, what the
engine has sent it so far (``Reply``, holding back what may start a stop string: ``StopText``) and
the ``Outcome`` it ends with, which the formats read.
"""

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Optional

from decoder.row import DecodingStats
from decoder.text import TextStream
from server.request import GenerationRequest


@dataclass
class Outcome:
    """What a finished generation reports after its last text event."""

    text: str
    finish_reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose cache entries came from the prompt cache
    stop_sequence: Optional[str] = None  # the stop string that ended it, if one did
    stats: DecodingStats = field(default_factory=DecodingStats)
    logprobs: Optional[list] = None  # with request.logprobs: an OpenAILogprob per generated token
    # the generated tokens (reasoning_tokens counts some of them)
    tokens: list = field(default_factory=list)


class Job:
    """A queued request and the events its handler awaits: ("start", None), ("text", (str,
    logprobs)), then ("done", Outcome) or ("error", ApiError). A text event's logprobs are None when
    the request did not ask, else the OpenAILogprobs of the tokens since the last text event."""

    def __init__(
        self,
        request: GenerationRequest,
        loop: Optional[asyncio.AbstractEventLoop],
        constraint=None,
        forced=None,
        release=None,
        label: Optional[str] = None,
    ):
        self.request = request
        self.label = label  # its id and API, for the log (server/failures.py)
        self.loop = loop
        self.constraint, self.forced = constraint, forced  # the request's own, or None
        self.events = asyncio.Queue() if loop is not None else None
        self.cancelled = threading.Event()
        self._release = release  # called once, when the engine is done with the job

    def send(self, kind: str, payload=None):
        if self.loop is not None:  # None: another rank's request, followed here in lockstep
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        if kind in ("done", "error"):
            self.release()

    def release(self):
        release, self._release = self._release, None
        if release is not None:
            release()


class StopText:
    """Holds back text that may be the start of a stop string, and cuts the text at one."""

    def __init__(self, stop: list):
        self.stop = stop
        self.held = ""
        self.found = None  # the stop string found

    def add(self, piece: str) -> tuple:
        """``(text safe to send, whether a stop string was found)``."""
        self.held += piece
        found = [(i, s) for i, s in ((self.held.find(s), s) for s in self.stop) if i >= 0]
        if found:
            index, self.found = min(found)
            text, self.held = self.held[:index], ""
            return text, True
        keep = max(
            (k for s in self.stop for k in range(1, len(s)) if self.held.endswith(s[:k])), default=0
        )
        text, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return text, False

    def flush(self) -> str:
        text, self.held = self.held, ""
        return text


class Reply:
    """What a running job has been sent: its text, held-back stop-string prefixes, its tokens."""

    def __init__(self, job: Job, tokenizer, cached: int):
        self.job, self.text, self.stopper = job, TextStream(tokenizer), StopText(job.request.stop)
        self.outcome = Outcome("", "length", len(job.request.prompt), 0, cached)
        self.pieces, self.generated = [], []
        # logprobs are formatted where a client reads them
        asked = job.request.logprobs is not None and job.loop is not None
        self.pending = [] if asked else None  # TokenLogprobs not yet sent with a text event
        self.outcome.logprobs = [] if asked else None

    def send(self, piece: str):
        """Send ``piece`` with the logprobs of the tokens since the last one."""
        self.pieces.append(piece)
        if self.pending is not None:
            self.outcome.logprobs += self.pending
        self.job.send("text", (piece, self.pending))
        self.pending = [] if self.pending is not None else None
