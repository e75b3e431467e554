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
"""

import threading
import time
import uuid
from collections import OrderedDict

from server.engine import Outcome
from server.formats import Format, Reasoning, sse
from server.protocol import (
    ApiError,
    GenerationRequest,
    check_fields_and_model,
    effort_request,
    function_of,
    invalid,
    number,
    prepare_chat,
    response_schema,
    tool_choice,
    typed,
)
from server.reasoning import EFFORT_BUDGETS
from server.tools import Call

FIELDS = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "text",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "previous_response_id",
    "parallel_tool_calls",
    "store",
    "reasoning",
    "thinking_token_budget",
}
# Accepted and ignored: bookkeeping on OpenAI's side, or options that change nothing here.
IGNORED = {
    "metadata",
    "user",
    "service_tier",
    "truncation",
    "include",
    "prompt_cache_key",
    "safety_identifier",
    "prompt_cache_retention",
    "stream_options",
    "background",
}


class ResponseStore:
    """The conversations (chat messages, the answer last) of the last ``size`` responses stored;
    the least recently stored go first. Handlers read and write it from several threads."""

    def __init__(self, size: int):
        self.size, self.entries, self.lock = size, OrderedDict(), threading.Lock()

    def add(self, response_id: str, messages: list):
        with self.lock:
            self.entries[response_id] = messages
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)

    def get(self, response_id: str) -> list:
        with self.lock:
            if response_id not in self.entries:
                raise ApiError(
                    404,
                    f"previous_response_id: no response '{response_id}' is kept (this server keeps "
                    f"the last {self.size} stored responses); send the whole conversation in 'input'",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            return self.entries[response_id]


def parse_responses(
    body: dict,
    tokenizer,
    model_id: str,
    default_max_tokens: int,
    store: ResponseStore,
    effort_budgets: dict = EFFORT_BUDGETS,
) -> GenerationRequest:
    """A /v1/responses body."""
    check_fields_and_model(body, FIELDS, model_id, IGNORED)
    max_tokens = typed(body, "max_output_tokens", (int,), default_max_tokens, "an integer")
    if max_tokens < 1:
        raise invalid("'max_output_tokens' must be at least 1", param="max_output_tokens")
    temp = float(number(body, "temperature", 1.0, 0.0, 2.0))
    request = GenerationRequest(
        prompt=[],
        max_tokens=max_tokens,
        temp=0.0 if temp < 1e-6 else temp,
        top_p=max(float(number(body, "top_p", 1.0, 0.0, 1.0)), 1e-9),
        stream=typed(body, "stream", (bool,), False, "a boolean"),
    )
    previous = typed(body, "previous_response_id", (str,), None, "a string")
    conversation = (store.get(previous) if previous else []) + _input_messages(body.get("input"))
    instructions = typed(body, "instructions", (str,), None, "a string")
    functions = [
        _function(tool, i)
        for i, tool in enumerate(typed(body, "tools", (list,), [], "a list of tools"))
    ]
    choice = tool_choice(
        body.get("tool_choice"),
        functions,
        lambda choice: choice.get("name") if choice.get("type") == "function" else None,
        "{'type': 'function', 'name': <one of tools>}",
    )
    text = typed(body, "text", (dict,), {}, "an object")
    request.schema = response_schema(
        _as_response_format(typed(text, "format", (dict,), {"type": "text"}, "an object")),
        "text.format",
    )
    parallel = typed(body, "parallel_tool_calls", (bool,), True, "a boolean")
    reasoning = typed(body, "reasoning", (dict,), {}, "an object")
    thinking = effort_request(
        reasoning.get("effort"),
        "reasoning.effort",
        effort_budgets,
        body.get("thinking_token_budget"),
    )
    prepare_chat(
        request,
        ([{"role": "system", "content": instructions}] if instructions else []) + conversation,
        functions,
        choice,
        parallel,
        tokenizer,
        thinking,
    )
    stored = typed(body, "store", (bool,), True, "a boolean")
    request.messages = conversation if stored and store.size else None  # what a follow-up builds on
    return request


def _as_response_format(spec: dict) -> dict:
    """``text.format`` (the schema's fields flat) in chat's ``response_format`` shape."""
    if spec.get("type") != "json_schema":
        return spec
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if k != "type"}}


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict)
        and p.get("type") in ("input_text", "output_text", "text")
        and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise invalid(
        f"{where}: only text content is supported (a string or input_text/output_text parts)",
        param=where,
    )


def _input_messages(items) -> list:
    """Chat messages for ``input``: a function_call joins the assistant message before it (or
    starts one), a function_call_output is a ``tool`` message; a reasoning item's text is the
    ``reasoning_content`` of the assistant message that follows it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise invalid("'input' must be a string or a non-empty list of items", param="input")
    # call_id -> tool name; reasoning waiting for its assistant turn
    chat, names, thought = [], {}, None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("user", "assistant", "system"):
                raise invalid(
                    f"{where}.role must be 'user', 'assistant', 'system' or 'developer'",
                    param=where,
                )
            chat.append(
                {"role": role, "content": _content(item.get("content"), f"{where}.content")}
            )
            if role == "assistant" and thought:
                chat[-1]["reasoning_content"], thought = thought, None
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(value, str) for value in (call_id, name, arguments)):
                raise invalid(
                    f"{where}: a function_call needs 'call_id', 'name' and 'arguments' strings",
                    param=where,
                )
            names[call_id] = name
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            if chat and chat[-1]["role"] == "assistant" and not thought:
                chat[-1] = {**chat[-1], "tool_calls": chat[-1].get("tool_calls", []) + [call]}
            else:
                chat.append(
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [call],
                        **({"reasoning_content": thought} if thought else {}),
                    }
                )
                thought = None
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            chat.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "name": names.get(call_id, ""),
                    "content": _content(item.get("output"), f"{where}.output"),
                }
            )
        elif kind == "reasoning":
            parts = [
                p
                for key in ("content", "summary")
                for p in (item.get(key) if isinstance(item.get(key), list) else [])
            ]
            thought = "".join(p.get("text", "") for p in parts if isinstance(p, dict)) or thought
        else:
            raise invalid(
                f"{where}: '{kind}' items are not supported (message, function_call and "
                "function_call_output are)",
                param=where,
            )
    return chat


def _function(tool, index: int):
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise invalid(
            f"{where}: only function tools ({{'type': 'function', 'name', 'parameters'}}) are supported",
            param=where,
        )
    return function_of(tool.get("name"), tool.get("parameters"), tool.get("description"), where)


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
            "temperature": self.request.temp,
            "top_p": self.request.top_p,
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
