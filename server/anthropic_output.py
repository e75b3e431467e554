"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, on the same engine.

A Messages body becomes OpenAI-style chat messages (``tool_use`` blocks an assistant's
``tool_calls``, ``tool_result`` blocks ``tool`` messages) and goes through ``prepare_chat`` as a
chat completion does, so the prompt, the tool constraint and the prompt cache are the same.
``output_config.format`` (a JSON schema) constrains the text as ``response_format`` does, after the
think block on a thinking model. ``thinking`` is honoured:
``{"type": "enabled", "budget_tokens": N}`` bounds the block (any N >= 1), ``disabled`` renders the
template with thinking off, ``adaptive`` (and no ``thinking``) leaves the template's default;
``output_config.effort`` maps to a budget (server/reasoning.py). Replies start with ``thinking``
blocks (their ``signature`` a digest of the text, which this server does not check when it comes
back); thinking blocks in the history are given to the template as the turn's ``reasoning_content``.
``metadata`` and ``service_tier`` change nothing and are accepted; ``container``, ``mcp_servers``
and ``context_management`` (Anthropic's server-side tools) only empty, and an unknown field is a
400 naming it, as Anthropic's API answers; ``top_k`` keeps the k most likely tokens
(1 is greedy), as the OpenAI side's ``top_k`` does (docs/sampling.md).

Usage follows Anthropic: ``input_tokens`` are the prompt tokens decoded now, and
``cache_read_input_tokens`` those whose KV entries came from the prompt cache (together, the
prompt). Errors are ``{"type": "error", "error": {"type", "message"}}`` with Anthropic's statuses
(a full queue is 529 "overloaded_error").

The request side (a body -> a ``GenerationRequest``) is anthropic_input.py; the replies and their
stream are here.
"""

import hashlib
import json
import uuid

from server.formats import Format, Reasoning, sse
from server.job import Outcome
from server.request import ApiError, GenerationRequest
from server.tools import Call

PING_S = 5.0  # a stream with nothing to say for this long sends a ping (a long prompt's prefill)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
ANTHROPIC_STATUS = {503: 529}  # our status -> Anthropic's, where they differ


def anthropic_error(error: ApiError) -> dict:
    status = ANTHROPIC_STATUS.get(error.status, error.status)
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def signature(thinking: str) -> str:
    """A thinking block's signature: a digest of its text (Anthropic's is opaque; clients send it
    back)."""
    return hashlib.sha256(thinking.encode()).hexdigest()


class MessagesFormat(Format):
    """Message objects, and their stream: message_start, then per content block
    content_block_start / content_block_delta (thinking_delta then signature_delta, text_delta,
    input_json_delta) / content_block_stop, message_delta (stop_reason, usage), message_stop; a ping
    after ``PING_S`` of silence."""

    ping_s = PING_S

    def __init__(self, model_id: str, request: GenerationRequest):
        super().__init__(model_id, request)
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.cached = 0  # prompt tokens found in the prompt cache
        # content blocks started; the last open
        self.blocks, self.text_open, self.called = 0, False, False
        self.thinking = None  # the open thinking block's text so far

    def _message(self, content: list, outcome: Outcome = None) -> dict:
        stop_reason = None if outcome is None else self._stop_reason(outcome)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model_id,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None if outcome is None else outcome.stop_sequence,
            "usage": self._usage(outcome),
        }

    def _usage(self, outcome: Outcome = None) -> dict:
        cached = self.cached if outcome is None else outcome.cached_tokens
        return {
            "input_tokens": len(self.request.prompt) - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": 0 if outcome is None else outcome.completion_tokens,
        }

    def _stop_reason(self, outcome: Outcome) -> str:
        if outcome.finish_reason == "length":
            return "max_tokens"
        if outcome.stop_sequence is not None:
            return "stop_sequence"
        return "tool_use" if self.called else "end_turn"

    @staticmethod
    def _tool_use(call: Call) -> dict:
        return {
            "type": "tool_use",
            "id": call.id or f"toolu_{uuid.uuid4().hex[:24]}",
            "name": call.name,
            "input": json.loads(call.arguments),
        }

    def full(self, outcome: Outcome) -> dict:
        text, calls = self.split(outcome)
        self.called = bool(calls)
        reasoning = self.reasoning(outcome)
        thinking = (
            [{"type": "thinking", "thinking": reasoning, "signature": signature(reasoning)}]
            if reasoning
            else []
        )
        return self._message(
            thinking
            + ([{"type": "text", "text": text}] if text else [])
            + [self._tool_use(c) for c in calls],
            outcome,
        )

    def _event(self, kind: str, **fields) -> str:
        return sse({"type": kind, **fields}, kind)

    def _close_text(self) -> list:
        if self.thinking is not None:
            thinking, self.thinking, self.blocks = self.thinking, None, self.blocks + 1
            return [
                self._event(
                    "content_block_delta",
                    index=self.blocks - 1,
                    delta={"type": "signature_delta", "signature": signature(thinking)},
                ),
                self._event("content_block_stop", index=self.blocks - 1),
            ]
        if not self.text_open:
            return []
        self.text_open, self.blocks = False, self.blocks + 1
        return [self._event("content_block_stop", index=self.blocks - 1)]

    def _items(self, items: list) -> list:
        events = []
        for item in items:
            if isinstance(item, Reasoning):
                if self.thinking is None:
                    events.append(
                        self._event(
                            "content_block_start",
                            index=self.blocks,
                            content_block={"type": "thinking", "thinking": "", "signature": ""},
                        )
                    )
                    self.thinking = ""
                self.thinking += item.text
                events.append(
                    self._event(
                        "content_block_delta",
                        index=self.blocks,
                        delta={"type": "thinking_delta", "thinking": item.text},
                    )
                )
                continue
            if self.thinking is not None:
                events += self._close_text()
            if isinstance(item, str):
                if not self.text_open:
                    events.append(
                        self._event(
                            "content_block_start",
                            index=self.blocks,
                            content_block={"type": "text", "text": ""},
                        )
                    )
                    self.text_open = True
                events.append(
                    self._event(
                        "content_block_delta",
                        index=self.blocks,
                        delta={"type": "text_delta", "text": item},
                    )
                )
                continue
            events += self._close_text()
            block = self._tool_use(item)
            events += [
                self._event(
                    "content_block_start", index=self.blocks, content_block={**block, "input": {}}
                ),
                self._event(
                    "content_block_delta",
                    index=self.blocks,
                    delta={"type": "input_json_delta", "partial_json": item.arguments},
                ),
                self._event("content_block_stop", index=self.blocks),
            ]
            self.blocks, self.called = self.blocks + 1, True
        return events

    def start(self, cached: int) -> list:
        self.cached = cached
        return [self._event("message_start", message=self._message([]))]

    def text(self, piece: str, logprobs) -> list:
        return self._items(self.read(piece))

    def done(self, outcome: Outcome) -> list:
        events = self._items(self.read("", finish=True)) + self._close_text()
        delta = {"stop_reason": self._stop_reason(outcome), "stop_sequence": outcome.stop_sequence}
        return events + [
            self._event("message_delta", delta=delta, usage=self._usage(outcome)),
            self._event("message_stop"),
        ]

    def failed(self, error: ApiError) -> list:
        return [sse(anthropic_error(error), "error")]

    def ping(self) -> list:
        return [self._event("ping")]
