"""OpenAI's Responses API: POST /v1/responses, on the same engine.

``input`` (a string, or message, function_call and function_call_output items) becomes chat
messages and goes through ``prepare_chat`` as a chat completion does; ``instructions`` is a system
message first, ``text.format`` a response format, function ``tools`` and ``tool_choice`` the
chat ones. Output is ``message`` items (``output_text``) and ``function_call`` items.

``previous_response_id``: the server keeps the conversations of its last ``stored_responses``
answers (``build_app``; 256 by default, in memory, least recent out) unless a request says
``store: false``. A follow-up names one and sends only the new items; an id no longer kept is a
404 that says so. Agents that resend the whole history need none of it. As in OpenAI's API, the
earlier ``instructions`` are not carried over.

On a thinking model ``reasoning.effort`` (or ``thinking_token_budget``) bounds the think block
(server/reasoning.py), and the output starts with a ``reasoning`` item whose ``content`` is
``[{"type": "reasoning_text", "text": ...}]``, streamed as ``response.reasoning_text.delta`` and
``.done``. A reasoning item in ``input`` (or kept for ``previous_response_id``) is the next
assistant turn's ``reasoning_content``, which the template keeps or drops.

A stream ends with ``response.completed`` also when ``max_output_tokens`` cut the answer short
(status "incomplete", ``incomplete_details.reason`` "max_output_tokens").

The request side (a body -> a ``GenerationRequest``) is responses_input.py; the output items and
their stream are here (``ResponsesFormat``).
"""

import time
import uuid

from server.formats import Format, Reasoning, sse
from server.job import Outcome
from server.request import ApiError, GenerationRequest
from server.responses_input import ResponseStore, opaque
from server.tools import Call


class ResponsesFormat(Format):
    """Response objects, and their stream: response.created, response.in_progress, then per output
    item output_item.added, its content (content_part.added, output_text.delta ...,
    output_text.done, content_part.done; or function_call_arguments.delta and .done),
    output_item.done; last response.completed with the whole output and usage."""

    def __init__(self, model_id: str, request: GenerationRequest, store: ResponseStore):
        super().__init__(model_id, request)
        self.store = store
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.sequence = 0  # every event's sequence_number
        self.output = []  # finished output items
        self.message = None  # the open message item, while text streams into it
        self.thought = None  # the open reasoning item, while reasoning streams into it

    def _response(self, status: str, outcome: Outcome = None) -> dict:
        tools = [] if self.request.tools is None else self.request.tools.functions
        response = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model_id,
            "output": self.output if outcome is not None else [],
            "error": None,
            "incomplete_details": None,
            "instructions": None,
            "metadata": {},
            "parallel_tool_calls": self.request.tools is None or self.request.tools.parallel,
            "temperature": self.request.sampling.temp,
            "top_p": self.request.sampling.top_p,
            "tool_choice": "auto",
            "tools": [
                {
                    "type": "function",
                    "name": f.name,
                    "description": f.description,
                    "parameters": f.parameters,
                    "strict": False,
                }
                for f in tools
            ],
            "usage": None,
        }
        if outcome is not None:
            response["usage"] = {
                "input_tokens": outcome.prompt_tokens,
                "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
                "output_tokens": outcome.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens(outcome)},
                "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
            }
            if outcome.finish_reason == "length":
                response["incomplete_details"] = {"reason": "max_output_tokens"}
        return response

    def _event(self, kind: str, **fields) -> str:
        self.sequence += 1
        return sse({"type": kind, "sequence_number": self.sequence - 1, **fields}, kind)

    def _close_message(self) -> list:
        if self.message is None:
            return []
        item, self.message = self.message, None
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": len(self.output)}
        item["status"] = "completed"
        events = [
            self._event(
                "response.output_text.done",
                **where,
                content_index=0,
                text=part["text"],
                logprobs=[],
            ),
            self._event("response.content_part.done", **where, content_index=0, part=part),
            self._event("response.output_item.done", output_index=len(self.output), item=item),
        ]
        self.output.append(item)
        return events

    def _reasoning(self, piece: str) -> list:
        events = []
        if self.thought is None:
            self.thought = {
                "id": f"rs_{uuid.uuid4().hex}",
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            events.append(
                self._event(
                    "response.output_item.added",
                    output_index=len(self.output),
                    item={**self.thought, "content": []},
                )
            )
            self.thought["content"].append({"type": "reasoning_text", "text": ""})
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=self.thought["id"],
                    output_index=len(self.output),
                    content_index=0,
                    part={"type": "reasoning_text", "text": ""},
                )
            )
        self.thought["content"][0]["text"] += piece
        return events + [
            self._event(
                "response.reasoning_text.delta",
                item_id=self.thought["id"],
                output_index=len(self.output),
                content_index=0,
                delta=piece,
            )
        ]

    def _close_reasoning(self) -> list:
        if self.thought is None:
            return []
        item, self.thought = self.thought, None
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": len(self.output), "content_index": 0}
        item["status"] = "completed"
        if self.request.opaque_reasoning:
            item["encrypted_content"] = opaque(part["text"])
        events = [
            self._event("response.reasoning_text.done", **where, text=part["text"]),
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=len(self.output), item=item),
        ]
        self.output.append(item)
        return events

    def _items(self, items: list) -> list:
        events = []
        for item in items:
            if isinstance(item, Reasoning):
                events += self._reasoning(item.text)
                continue
            events += self._close_reasoning()
            if isinstance(item, str):
                if self.message is None:
                    self.message = {
                        "id": f"msg_{uuid.uuid4().hex}",
                        "type": "message",
                        "role": "assistant",
                        "status": "in_progress",
                        "content": [],
                    }
                    events.append(
                        self._event(
                            "response.output_item.added",
                            output_index=len(self.output),
                            item={**self.message, "content": []},
                        )
                    )
                    self.message["content"].append(
                        {"type": "output_text", "text": "", "annotations": []}
                    )
                    events.append(
                        self._event(
                            "response.content_part.added",
                            item_id=self.message["id"],
                            output_index=len(self.output),
                            content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []},
                        )
                    )
                self.message["content"][0]["text"] += item
                events.append(
                    self._event(
                        "response.output_text.delta",
                        item_id=self.message["id"],
                        output_index=len(self.output),
                        content_index=0,
                        delta=item,
                        logprobs=[],
                    )
                )
                continue
            events += self._close_message()
            events += self._call(item)
        return events

    def _call(self, call: Call) -> list:
        item = {
            "id": f"fc_{uuid.uuid4().hex}",
            "type": "function_call",
            "status": "in_progress",
            "call_id": call.id or f"call_{uuid.uuid4().hex[:24]}",
            "name": call.name,
            "arguments": "",
        }
        where = {"item_id": item["id"], "output_index": len(self.output)}
        events = [
            self._event(
                "response.output_item.added", output_index=len(self.output), item=dict(item)
            ),
            self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self._event(
                "response.function_call_arguments.done",
                **where,
                name=call.name,
                arguments=call.arguments,
            ),
        ]
        item.update(arguments=call.arguments, status="completed")
        events.append(
            self._event("response.output_item.done", output_index=len(self.output), item=item)
        )
        self.output.append(item)
        return events

    def _finish(self, outcome: Outcome) -> dict:
        """The finished response; its conversation is stored for a follow-up."""
        if self.request.messages is not None:
            text = "".join(
                part["text"]
                for item in self.output
                if item["type"] == "message"
                for part in item["content"]
            )
            calls = [
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
                for item in self.output
                if item["type"] == "function_call"
            ]
            thought = "".join(
                part["text"]
                for item in self.output
                if item["type"] == "reasoning"
                for part in item["content"]
            )
            answer = {
                "role": "assistant",
                "content": text,
                **({"tool_calls": calls} if calls else {}),
                **({"reasoning_content": thought} if thought else {}),
            }
            self.store.add(self.id, self.request.messages + [answer])
        return self._response(
            "incomplete" if outcome.finish_reason == "length" else "completed", outcome
        )

    def full(self, outcome: Outcome) -> dict:
        self._items(self.read(outcome.text, finish=True))  # the stream's items, events unsent
        self._close_reasoning()
        self._close_message()
        return self._finish(outcome)

    def start(self, cached: int) -> list:
        return [
            self._event("response.created", response=self._response("in_progress")),
            self._event("response.in_progress", response=self._response("in_progress")),
        ]

    def text(self, piece: str, logprobs) -> list:
        return self._items(self.read(piece))

    def done(self, outcome: Outcome) -> list:
        events = (
            self._items(self.read("", finish=True))
            + self._close_reasoning()
            + self._close_message()
        )
        return events + [self._event("response.completed", response=self._finish(outcome))]

    def failed(self, error: ApiError) -> list:
        response = {
            **self._response("failed"),
            "error": {"code": error.code or error.type, "message": error.message},
        }
        return [self._event("response.failed", response=response)]
