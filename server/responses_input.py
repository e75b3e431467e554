"""The request side of OpenAI's Responses API (its output side: responses_output.py): a
/v1/responses body -> a checked ``GenerationRequest``, its ``input`` items read as chat messages,
and ``ResponseStore``, the conversations a later ``previous_response_id`` continues.
"""

import base64
import json
import threading
from collections import OrderedDict

from server.protocol import effort_request, function_of, prepare_chat, response_schema, tool_choice
from server.reasoning import EFFORT_BUDGETS
from server.request import (
    ApiError,
    GenerationRequest,
    check_fields_and_model,
    invalid,
    number,
    read_sampling,
    typed,
)

FIELDS = {
    "truncation",
    "background",
    "include",
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
# Accepted and ignored: bookkeeping on OpenAI's side, which changes nothing in the output.
IGNORED = {
    "metadata",
    "user",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "prompt_cache_retention",
    "stream_options",  # include_obfuscation: padding in stream events
}
# Fields read only to refuse what this server does not do: field -> the values it accepts.
ONLY = {
    "truncation": ("disabled",),  # "auto" would drop input items; this server never does
    "background": (False,),  # a background response answers before it is done
}
# ``include`` values that change nothing: the tools and image inputs they add data of never run or
# come here (only function tools and text are served)
INCLUDE_NOTHING = {
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "message.input_image.image_url",
}


# Asked by clients that store nothing server-side (Codex): each reasoning item carries its text as
# an opaque ``encrypted_content`` (base64, not encrypted: this server keeps no secret), which the
# client sends back in the next turn's input, where it is read as the item's text.
ENCRYPTED_REASONING = "reasoning.encrypted_content"


def opaque(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unwrapped(item: dict) -> str:
    """A reasoning item's ``encrypted_content`` text ("" where it is not one of ours)."""
    try:
        return base64.b64decode(item.get("encrypted_content") or "", validate=True).decode()
    except (ValueError, TypeError):
        return ""


def _check_unsupported(body: dict):
    """A 400 naming a field whose value would change the answer in a way this server does not
    honour (``ONLY``, ``include``, ``text.verbosity``)."""
    for name, accepted in ONLY.items():
        if body.get(name) is not None and body[name] not in accepted:
            raise invalid(
                f"'{name}' must be {' or '.join(json.dumps(a) for a in accepted)} here, "
                f"not {json.dumps(body[name])[:40]}",
                param=name,
            )
    include = typed(body, "include", (list,), [], "a list of strings")
    for value in include:
        if value not in INCLUDE_NOTHING | {ENCRYPTED_REASONING}:
            raise invalid(
                f"'include' value {json.dumps(value)[:60]} is not supported by this server",
                param="include",
            )
    verbosity = typed(body, "text", (dict,), {}, "an object").get("verbosity")
    if verbosity not in (None, "medium"):
        raise invalid("'text.verbosity' other than 'medium' is not supported", param="text")


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
                    f"the last {self.size} stored responses); send the "
                    "whole conversation in 'input'",
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
    _check_unsupported(body)
    max_tokens = typed(body, "max_output_tokens", (int,), default_max_tokens, "an integer")
    if max_tokens < 1:
        raise invalid("'max_output_tokens' must be at least 1", param="max_output_tokens")
    temp = float(number(body, "temperature", 1.0, 0.0, 2.0))
    top_p = max(float(number(body, "top_p", 1.0, 0.0, 1.0)), 1e-9)
    sampling = read_sampling(  # no mlx_lm.server extras in this API
        body, tokenizer, controls=(), temp=0.0 if temp < 1e-6 else temp, top_p=top_p
    )
    request = GenerationRequest(
        prompt=[],
        max_tokens=max_tokens,
        sampling=sampling,
        stream=typed(body, "stream", (bool,), False, "a boolean"),
        opaque_reasoning=ENCRYPTED_REASONING in body.get("include", []),
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
            text = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
            thought = text or _unwrapped(item) or thought
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
            f"{where}: only function tools ({{'type': 'function', 'name', 'parameters'}}) are "
            "supported",
            param=where,
        )
    return function_of(tool.get("name"), tool.get("parameters"), tool.get("description"), where)
