"""The request side of Anthropic's Messages API (its output side: anthropic_output.py): a
/v1/messages or /v1/messages/count_tokens body -> a checked ``GenerationRequest``, its content
blocks read as chat messages and its ``thinking`` and ``output_config.effort`` as a
``ThinkingRequest``.
"""

from server.protocol import (
    budget_field,
    effort_request,
    function_of,
    named_choice,
    prepare_chat,
    response_schema,
)
from server.reasoning import EFFORT_BUDGETS, ThinkingRequest
from server.request import (
    SERVER_SETTINGS,
    ApiError,
    GenerationRequest,
    invalid,
    number,
    read_sampling,
    typed,
)

# The Messages fields read here; the ones that change nothing in the output are accepted, and a
# field that would change it and is not honoured is a 400 that names it (``_check_fields``).
MESSAGES_FIELDS = {
    "model",
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
}
MESSAGES_IGNORED = {"metadata", "service_tier"}  # bookkeeping on Anthropic's side
# tools run on Anthropic's side: accepted only empty
MESSAGES_UNSUPPORTED = {"container", "mcp_servers", "context_management"}


def _check_fields(body: dict):
    """Refuse a field this server does not honour, as Anthropic refuses unknown ones."""
    for name in sorted(set(body) - MESSAGES_FIELDS - MESSAGES_IGNORED - SERVER_SETTINGS):
        if name in MESSAGES_UNSUPPORTED:
            if body[name] in (None, [], {}):
                continue
            raise invalid(f"{name}: not supported by this server", param=name)
        raise invalid(f"{name}: Extra inputs are not permitted", param=name)


def parse_messages(
    body: dict,
    tokenizer,
    model_id: str,
    default_max_tokens: int,
    counting: bool = False,
    effort_budgets: dict = EFFORT_BUDGETS,
) -> GenerationRequest:
    """A /v1/messages body (``counting``: a count_tokens body, which has no max_tokens)."""
    _check_fields(body)
    model = typed(body, "model", (str,), model_id, "a string")
    if model != model_id:
        raise ApiError(
            404, f"model: '{model}' does not exist; this server serves '{model_id}'", param="model"
        )
    max_tokens = 1 if counting else typed(body, "max_tokens", (int,), None, "an integer")
    if max_tokens is None or max_tokens < 1:
        raise invalid("max_tokens: a positive integer is required", param="max_tokens")
    temp = float(number(body, "temperature", 1.0, 0.0, 1.0))  # 1 is Anthropic's default
    top_k = typed(body, "top_k", (int,), None, "an integer")
    if top_k is not None and top_k < 0:
        raise invalid("top_k: must be at least 0", param="top_k")
    stop = typed(body, "stop_sequences", (list,), [], "a list of strings")
    if not all(isinstance(s, str) and s for s in stop):
        raise invalid("stop_sequences: each must be a non-empty string", param="stop_sequences")
    sampling = read_sampling(
        body,
        tokenizer,
        controls=(),  # Anthropic's own top_k, read above
        temp=0.0 if top_k == 1 or temp < 1e-6 else temp,
        top_p=max(float(number(body, "top_p", 1.0, 0.0, 1.0)), 1e-9),
        top_k=top_k or 0,
    )
    request = GenerationRequest(
        prompt=[],
        max_tokens=max_tokens,
        sampling=sampling,
        stop=stop,
        stream=typed(body, "stream", (bool,), False, "a boolean"),
    )
    messages = typed(body, "messages", (list,), None, "a list of messages")
    if not messages:
        raise invalid("messages: at least one message is required", param="messages")
    functions = [
        _function(tool, i)
        for i, tool in enumerate(typed(body, "tools", (list,), [], "a list of tools"))
    ]
    choice, parallel = _tool_choice(
        typed(body, "tool_choice", (dict,), {"type": "auto"}, "an object"), functions
    )
    config = typed(body, "output_config", (dict,), {}, "an object")
    thinking = _thinking(
        typed(body, "thinking", (dict,), None, "an object"), config.get("effort"), effort_budgets
    )
    output = typed(config, "format", (dict,), None, "an object")
    if output is not None:  # structured output: {"type": "json_schema", "schema": {...}}
        if output.get("type") != "json_schema" or not isinstance(output.get("schema"), dict):
            raise invalid(
                "output_config.format: must be {'type': 'json_schema', 'schema': {...}}",
                param="output_config",
            )
        request.schema = response_schema(
            {"type": "json_schema", "json_schema": {"schema": output["schema"]}},
            "output_config.format",
        )
    chat = _system(body.get("system")) + _chat_messages(messages)
    return prepare_chat(request, chat, functions, choice, parallel, tokenizer, thinking)


def _thinking(thinking, effort, budgets: dict) -> ThinkingRequest:
    """``thinking`` (enabled with budget_tokens, adaptive, disabled) and
    ``output_config.effort``."""
    asked = effort_request(effort, "output_config.effort", budgets)
    if thinking is None:
        return asked
    kind = thinking.get("type")
    if kind == "disabled":
        return ThinkingRequest(enabled=False)
    if kind == "enabled":
        budget = budget_field(thinking.get("budget_tokens"), "thinking.budget_tokens")
        if budget is None:
            raise invalid(
                "thinking.budget_tokens: a positive integer is required", param="thinking"
            )
        return ThinkingRequest(enabled=True, budget=budget)
    if kind == "adaptive":
        return asked
    raise invalid("thinking.type: must be 'enabled', 'adaptive' or 'disabled'", param="thinking")


def _text(blocks, where: str) -> str:
    """A string, or text blocks joined; anything else is refused."""
    if isinstance(blocks, str):
        return blocks
    if isinstance(blocks, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
        for b in blocks
    ):
        return "\n\n".join(b["text"] for b in blocks)
    raise invalid(f"{where}: only a string or text blocks are supported here", param=where)


def _system(system) -> list:
    if system is None:
        return []
    return [{"role": "system", "content": _text(system, "system")}]


def _chat_messages(messages: list) -> list:
    """Messages in chat form: text, ``tool_use`` (an assistant's calls) and ``tool_result`` (each a
    ``tool`` message, before the rest of its user turn); an assistant's thinking blocks are its
    ``reasoning_content`` (redacted ones are left out)."""
    chat, names = [], {}  # tool_use id -> tool name, for the results that answer it
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise invalid(f"{where}.role: must be 'user' or 'assistant'", param=where)
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise invalid(
                f"{where}.content: must be a string or a list of content blocks", param=where
            )
        texts, calls, results, thoughts = [], [], [], []
        for j, block in enumerate(blocks):
            kind = block.get("type") if isinstance(block, dict) else None
            place = f"{where}.content[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                name, call_id, arguments = (
                    block.get("name"),
                    block.get("id"),
                    block.get("input", {}),
                )
                if (
                    not isinstance(name, str)
                    or not isinstance(call_id, str)
                    or not isinstance(arguments, dict)
                ):
                    raise invalid(
                        f"{place}: a tool_use block needs an 'id', a 'name' and an 'input' object",
                        param=place,
                    )
                names[call_id] = name
                calls.append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": arguments},
                    }
                )
            elif kind == "tool_result" and role == "user":
                result = _text(block.get("content", ""), f"{place}.content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                call_id = block.get("tool_use_id")
                results.append(
                    {
                        "role": "tool",
                        "tool_call_id": call_id,
                        "name": names.get(call_id, ""),
                        "content": result,
                    }
                )
            elif kind == "thinking" and isinstance(block.get("thinking"), str):
                thoughts.append(block["thinking"])
            elif kind not in ("thinking", "redacted_thinking"):
                raise invalid(
                    f"{place}: '{kind}' blocks are not supported here (text, tool_use from the "
                    "assistant and tool_result from the user are)",
                    param=place,
                )
        if role == "assistant":
            answer = {"role": "assistant", "content": "\n\n".join(texts)}
            if thoughts and role == "assistant":
                answer["reasoning_content"] = "\n\n".join(thoughts)
            chat.append({**answer, "tool_calls": calls} if calls else answer)
        else:
            chat += results
            if texts or not results:
                chat.append({"role": "user", "content": "\n\n".join(texts)})
    return chat


def _function(tool, index: int):
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        raise invalid(
            f"{where}: only custom tools ({{'name', 'description', 'input_schema'}}) are supported",
            param=where,
        )
    return function_of(tool.get("name"), tool.get("input_schema"), tool.get("description"), where)


def _tool_choice(choice: dict, functions: list) -> tuple:
    """(choice as prepare_chat takes it, whether several calls may be made)."""
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        if not functions:
            raise invalid("tool_choice: 'any' needs tools", param="tool_choice")
        return "required", parallel
    if kind == "tool":
        return named_choice(
            choice.get("name"), functions, "tool_choice: 'name' must be one of the tools"
        ), parallel
    raise invalid("tool_choice.type: must be 'auto', 'any', 'tool' or 'none'", param="tool_choice")
