"""How an engine job's events read in OpenAI's chat and completions APIs, and what every API's
format does.

A format is made per request. ``full(outcome)`` is the JSON answer; a stream is ``start(cached)``,
``text(piece, logprobs)`` per text event, then ``done(outcome)`` or ``failed(error)``, each a list
of server-sent events. Tool calls are read out of the text by the request's reader (tools.py), so
every API shows the same text and the same calls. Anthropic's Messages and OpenAI's Responses
formats (anthropic_output.py, responses_output.py) follow the same shape.
"""

import json
import time
import uuid
from dataclasses import dataclass

from constrained.thinking import ReasoningSplitter
from server.job import Outcome
from server.request import ApiError, GenerationRequest
from server.tools import Call, reader_for, split


def sse(data: dict, event: str = None) -> str:
    """One server-sent event; ``event`` names it (Anthropic and Responses do, chat completions
    not)."""
    return (f"event: {event}\n" if event else "") + f"data: {json.dumps(data)}\n\n"


@dataclass(frozen=True)
class Reasoning:
    """A piece of the think block's text, as ``Format.read`` gives it among text and calls."""

    text: str


class Format:
    """One request's answer in one API's terms (see the module docstring). On a thinking model the
    think block is split off first (server/reasoning.py); the answer's text is read for calls."""

    ping_s = None  # seconds of silence in a stream after which ``ping()`` is sent; None: never
    index = 0  # the choice it answers (OpenAI's n; server/choices.py)

    def __init__(self, model_id: str, request: GenerationRequest):
        self.model_id, self.request = model_id, request
        # the stream's; ``full`` reads the whole text afresh
        self.reader = reader_for(request.tools)
        self.splitter = (
            ReasoningSplitter(None) if request.thinking is None else request.thinking.splitter()
        )

    def _split_reasoning(self, outcome: Outcome) -> tuple:
        thinking = self.request.thinking
        return ("", outcome.text) if thinking is None else thinking.split(outcome.text)

    def split(self, outcome: Outcome) -> tuple:
        """``(text, calls)`` of a whole output's answer."""
        return split(reader_for(self.request.tools), self._split_reasoning(outcome)[1])

    def reasoning(self, outcome: Outcome) -> str:
        """The think block's text of a whole output ("" for none)."""
        return self._split_reasoning(outcome)[0]

    def reasoning_tokens(self, outcome: Outcome) -> int:
        thinking = self.request.thinking
        return 0 if thinking is None else thinking.reasoning_tokens(outcome.tokens)

    def read(self, piece: str, finish: bool = False) -> list:
        """A streamed piece as ``Reasoning``, text (str) and ``Call`` items; ``finish``: and what
        was held."""
        items = []
        for kind, text in self.splitter.add(piece) + (self.splitter.finish() if finish else []):
            items += [Reasoning(text)] if kind == "reasoning" else self.reader.add(text)
        return items + (self.reader.finish() if finish else [])

    def ping(self) -> list:
        return []


def usage(outcome: Outcome, reasoning_tokens: int = 0) -> dict:
    """OpenAI's token counts; ``decoding`` is our extension: the target's forward passes and the
    drafts."""
    stats = outcome.stats
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "decoding": {
            "target_forward_passes": stats.target_forward_passes,
            "draft_proposed": stats.draft_proposed,
            "draft_accepted": stats.draft_accepted,
            "prompt_time_s": round(stats.prompt_time, 4),
        },
    }


class ChatFormat(Format):
    """chat.completion objects and chat.completion.chunk events. Tool calls become ``tool_calls``
    (streamed as each call completes), with finish_reason "tool_calls". ``logprobs`` is
    ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``."""

    def __init__(self, model_id: str, request: GenerationRequest):
        super().__init__(model_id, request)
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self.calls = 0  # tool calls streamed so far

    def _object(self, kind: str, choices: list, **extra) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model_id,
            "choices": choices,
            **extra,
        }

    @staticmethod
    def _call(call: Call) -> dict:
        return {
            "id": call.id or f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }

    @staticmethod
    def _finish_reason(outcome: Outcome, called: bool) -> str:
        return "tool_calls" if called and outcome.finish_reason == "stop" else outcome.finish_reason

    def full(self, outcome: Outcome) -> dict:
        text, calls = self.split(outcome)
        message = {"role": "assistant", "content": text if text or not calls else None}
        if reasoning := self.reasoning(outcome):  # reasoning_content: the name older clients read
            message["reasoning"] = message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [self._call(call) for call in calls]
        choice = {
            "index": self.index,
            "message": message,
            "finish_reason": self._finish_reason(outcome, bool(calls)),
            "logprobs": self._logprobs(outcome.logprobs),
        }
        return self._object(
            "chat.completion", [choice], usage=usage(outcome, self.reasoning_tokens(outcome))
        )

    @staticmethod
    def _logprobs(entries) -> dict:
        if entries is None:
            return None

        def described(token, raw, logprob):
            return {"token": token, "logprob": logprob, "bytes": raw}

        return {
            "content": [
                {
                    **described(e.token, e.bytes, e.logprob),
                    "top_logprobs": [described(*t) for t in e.top],
                }
                for e in entries
            ],
            "refusal": None,
        }

    def _chunk(self, delta: dict, finish_reason: str = None, logprobs=None) -> str:
        return sse(
            self._object(
                "chat.completion.chunk",
                [
                    {
                        "index": self.index,
                        "delta": delta,
                        "finish_reason": finish_reason,
                        "logprobs": self._logprobs(logprobs),
                    }
                ],
            )
        )

    def _items(self, items: list, logprobs=None) -> list:
        """The chunks for what the reader let out: reasoning first, then text and calls (none if
        nothing, logprobs aside)."""
        chunks = []
        if reasoning := "".join(item.text for item in items if isinstance(item, Reasoning)):
            delta = {"reasoning": reasoning, "reasoning_content": reasoning}
            if all(isinstance(item, Reasoning) for item in items):
                return [self._chunk(delta, logprobs=logprobs)]
            chunks.append(self._chunk(delta))
        delta = {}
        if text := "".join(item for item in items if isinstance(item, str)):
            delta["content"] = text
        if calls := [item for item in items if isinstance(item, Call)]:
            delta["tool_calls"] = [
                {"index": self.calls + i, **self._call(call)} for i, call in enumerate(calls)
            ]
            self.calls += len(calls)
        if not delta and logprobs is None:
            return chunks
        return chunks + [self._chunk(delta or {"content": ""}, logprobs=logprobs)]

    def start(self, cached: int) -> list:
        return [self._chunk({"role": "assistant", "content": ""})]

    def text(self, piece: str, logprobs) -> list:
        return self._items(self.read(piece), logprobs)

    def done(self, outcome: Outcome) -> list:
        events = self._items(self.read("", finish=True))
        events.append(self._chunk({}, self._finish_reason(outcome, self.calls > 0)))
        if self.request.include_usage:
            events.append(self.usage_event(usage(outcome, self.reasoning_tokens(outcome))))
        return events + ["data: [DONE]\n\n"]

    def usage_event(self, counts: dict) -> str:
        return sse(self._object("chat.completion.chunk", [], usage=counts))

    # the status line is sent already: say it in the stream
    def failed(self, error: ApiError) -> list:
        return [sse(error.body()), "data: [DONE]\n\n"]


class CompletionFormat(Format):
    """text_completion objects; streamed chunks have the same shape with a piece of the text. Legacy
    ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (per token a dict of the top ones
    and the chosen token, as OpenAI's), ``text_offset`` (where each token's string starts, counted
    over the completion's tokens from 0, across chunks when streaming)."""

    def __init__(self, model_id: str, request: GenerationRequest):
        super().__init__(model_id, request)
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        self.text_offset = 0

    def _object(self, choices: list, **extra) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model_id,
            "choices": choices,
            **extra,
        }

    def full(self, outcome: Outcome) -> dict:
        return self._object(
            [
                {
                    "index": self.index,
                    "text": outcome.text,
                    "finish_reason": outcome.finish_reason,
                    "logprobs": self._logprobs(outcome.logprobs),
                }
            ],
            usage=usage(outcome),
        )

    def _logprobs(self, entries) -> dict:
        if entries is None:
            return None
        offsets = []
        for entry in entries:
            offsets.append(self.text_offset)
            self.text_offset += len(entry.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [
                {**{token: logprob for token, _, logprob in e.top}, e.token: e.logprob}
                for e in entries
            ],
            "text_offset": offsets,
        }

    def _chunk(self, text: str, finish_reason: str = None, logprobs=None) -> str:
        return sse(
            self._object(
                [
                    {
                        "index": self.index,
                        "text": text,
                        "finish_reason": finish_reason,
                        "logprobs": self._logprobs(logprobs),
                    }
                ]
            )
        )

    def start(self, cached: int) -> list:
        return [self._chunk("")]

    def text(self, piece: str, logprobs) -> list:
        return [self._chunk(piece, logprobs=logprobs)]

    def done(self, outcome: Outcome) -> list:
        events = [self._chunk("", outcome.finish_reason)]
        if self.request.include_usage:
            events.append(self.usage_event(usage(outcome)))
        return events + ["data: [DONE]\n\n"]

    def usage_event(self, counts: dict) -> str:
        return sse(self._object([], usage=counts))

    def failed(self, error: ApiError) -> list:
        return [sse(error.body()), "data: [DONE]\n\n"]
