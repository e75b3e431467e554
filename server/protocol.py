"""Request bodies -> a validated ``GenerationRequest``, or an ``ApiError`` that says what is wrong.

OpenAI's chat and completions bodies are read here, with ``prepare_chat``, which turns chat
messages and tools into a prompt and a constraint the same way for chat completions, Anthropic
Messages (anthropic_input.py) and OpenAI Responses (responses_input.py). The request, its error and
the checks of single fields are in request.py; a chat message's, in chat_messages.py.

Validation is written out by hand: the rules are few, and each error message names the field, as
OpenAI's do. Unknown top-level fields are refused (OpenAI refuses them too), so a typo is an error
rather than a silently ignored option.
"""

import json
from typing import Callable, Optional

from constrained.thinking import thinking_of
from decoder.text import encode
from server.chat_messages import chat_message, for_template
from server.harmony import chat_tool_syntax
from server.reasoning import EFFORT_BUDGETS, ThinkingRequest, template_options
from server.request import (
    PROCESSOR_CONTROLS,
    SAMPLING_CONTROLS,
    GenerationRequest,
    check_fields_and_model,
    invalid,
    number,
    read_processors,
    read_sampling,
    typed,
)
from server.tools import Function, ToolUse

MAX_STOP_STRINGS = 4  # as OpenAI
MAX_CHOICES = 8  # n; the server's --max-batch may allow fewer (server/choices.py)
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API (its legacy completions allow 5; 20 here too, as vLLM)

COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "guided_regex",
    "guided_grammar",
    "logit_bias",
    *SAMPLING_CONTROLS,
    *PROCESSOR_CONTROLS,
}
CHAT_FIELDS = COMMON | {
    "messages",
    "max_completion_tokens",
    "response_format",
    "tools",
    "tool_choice",
    "logprobs",
    "top_logprobs",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "reasoning_effort",
    "thinking_token_budget",
    "modalities",
}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "suffix", "best_of", "logprobs"}


def _common(
    body: dict,
    allowed: set,
    model_id: str,
    max_tokens_field: Optional[int],
    default_max_tokens: int,
    tokenizer,
):
    check_fields_and_model(body, allowed, model_id)
    num_choices = typed(body, "n", (int,), 1, "an integer")
    if not 1 <= num_choices <= MAX_CHOICES:
        raise invalid(f"'n' must be an integer between 1 and {MAX_CHOICES}", param="n")
    max_tokens = default_max_tokens if max_tokens_field is None else max_tokens_field
    if max_tokens < 1:
        raise invalid("'max_tokens' must be at least 1", param="max_tokens")
    temp = float(number(body, "temperature", 1.0, 0.0, 2.0))  # 1 is OpenAI's default
    if 0 < temp < 1e-6:
        temp = 0.0  # float32 logits / temp overflow below this
    stop = typed(body, "stop", (str, list), [], "a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise invalid(f"'stop' must be up to {MAX_STOP_STRINGS} non-empty strings", param="stop")
    stream = typed(body, "stream", (bool,), False, "a boolean")
    options = typed(body, "stream_options", (dict,), {}, "an object")
    # top_p 0 keeps the top token, as in OpenAI's API
    top_p = max(float(number(body, "top_p", 1.0, 0.0, 1.0)), 1e-9)
    request = GenerationRequest(
        prompt=[],
        max_tokens=max_tokens,
        sampling=read_sampling(body, tokenizer, temp=temp, top_p=top_p),
        processors=read_processors(body),
        seed=typed(body, "seed", (int,), None, "an integer"),
        stop=stop,
        stream=stream,
        include_usage=stream and bool(options.get("include_usage")),
        num_choices=num_choices,
    )
    request.regex = typed(body, "guided_regex", (str,), None, "a string")
    request.grammar = typed(body, "guided_grammar", (str,), None, "a string")
    if request.seed is not None and not 0 <= request.seed < 2**64:
        raise invalid("'seed' must be in [0, 2**64)", param="seed")
    if request.regex is not None and request.grammar is not None:
        raise invalid("give guided_regex or guided_grammar, not both", param="guided_grammar")
    return request


def parse_chat(
    body: dict,
    tokenizer,
    model_id: str,
    default_max_tokens: int,
    effort_budgets: dict = EFFORT_BUDGETS,
) -> GenerationRequest:
    """A /v1/chat/completions body; ``tokenizer`` applies the chat template. ``effort_budgets``: the
    think-block budget of each ``reasoning_effort`` (server/reasoning.py)."""
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = typed({"max_tokens": limit}, "max_tokens", (int,), None, "an integer")
    request = _common(body, CHAT_FIELDS, model_id, max_tokens, default_max_tokens, tokenizer)
    top = _top_logprobs(body, "top_logprobs")
    if typed(body, "logprobs", (bool,), False, "a boolean"):
        request.logprobs = top or 0
    elif top:
        raise invalid("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    messages = typed(body, "messages", (list,), None, "a list of messages")
    if not messages:
        raise invalid("'messages' must be a non-empty list", param="messages")
    messages = [chat_message(m, i) for i, m in enumerate(messages)]
    functions = _chat_tools(typed(body, "tools", (list,), [], "a list of tools"))
    choice = tool_choice(
        body.get("tool_choice"),
        functions,
        lambda choice: choice.get("function", {}).get("name"),
        "{'type': 'function', 'function': {'name': <one of tools>}}",
    )
    request.schema = response_schema(
        typed(body, "response_format", (dict,), {"type": "text"}, "an object"), "response_format"
    )
    parallel = typed(body, "parallel_tool_calls", (bool,), True, "a boolean")
    if typed(body, "modalities", (list,), ["text"], "a list") != ["text"]:
        raise invalid("'modalities' must be [\"text\"]: this server writes text only", "modalities")
    thinking = effort_request(
        body.get("reasoning_effort"),
        "reasoning_effort",
        effort_budgets,
        body.get("thinking_token_budget"),
    )
    thinking.template_options = typed(body, "chat_template_kwargs", (dict,), {}, "an object")
    if thinking.enabled is None and isinstance(
        thinking.template_options.get("enable_thinking"), bool
    ):
        thinking.enabled = thinking.template_options["enable_thinking"]
    return prepare_chat(request, messages, functions, choice, parallel, tokenizer, thinking)


def budget_field(value, param: str) -> Optional[int]:
    """A token budget as a request gives it: a positive integer, or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(
            f"'{param}' must be a positive integer (tokens inside the think block)", param=param
        )
    return value


def effort_request(effort, param: str, budgets: dict, budget=None) -> ThinkingRequest:
    """An effort level (and an explicit budget, which wins) as a ``ThinkingRequest``."""
    budget = budget_field(budget, "thinking_token_budget")
    if effort is None:
        return ThinkingRequest(budget=budget, enabled=True if budget is not None else None)
    if effort == "none":
        return ThinkingRequest(enabled=False)
    if not isinstance(effort, str) or effort not in budgets:
        known = ", ".join(["none"] + sorted(budgets, key=lambda name: budgets[name] or 2**62))
        raise invalid(f"'{param}' must be one of {known}", param=param)
    return ThinkingRequest(enabled=True, budget=budget if budget is not None else budgets[effort])


def prepare_chat(
    request: GenerationRequest,
    messages: list,
    functions: list,
    choice: str,
    parallel: bool,
    tokenizer,
    thinking: Optional[ThinkingRequest] = None,
) -> GenerationRequest:
    """The prompt and the tool constraint of a chat request, whichever API it came in.

    Args:
        messages: OpenAI chat messages; an assistant's ``tool_calls`` have their arguments as JSON
            text or an object, a ``tool`` message answers one; its ``reasoning_content``, the
            reasoning the template may show.
        functions: the ``tools.Function``s offered; choice: "none", "auto", "required" or a name.
        thinking: what the request asks of a thinking model (None: the template's default).
    """
    thinking = thinking if thinking is not None else ThinkingRequest()
    if functions and choice != "none":
        tools = ToolUse(functions, choice, parallel, chat_tool_syntax(tokenizer))
        request.tool_grammar, schema = tools.grammar(), tools.json_schema()
        # no syntax: text only
        request.tools = None if tools.syntax is None and choice == "auto" else tools
        if request.schema is not None and (schema is not None or request.tool_grammar is not None):
            raise invalid(
                "give a response format or tools the model may call, not both", param="tools"
            )
        if schema is not None:
            request.schema = json.dumps(schema)
    elif (syntax := chat_tool_syntax(tokenizer)) is not None and syntax.reader is not None:
        # harmony's headers are markup, tools or not
        request.tools = ToolUse([], "auto", parallel, syntax)
    given = [request.regex, request.grammar, request.schema, request.tool_grammar]
    if sum(constraint is not None for constraint in given) > 1:
        raise invalid(
            "give one of a response format, a forced tool call, guided_regex and guided_grammar"
        )
    options = (
        {"tools": [f.for_template() for f in functions]} if functions and choice != "none" else {}
    )
    options |= template_options(thinking, tokenizer)
    request.messages = messages
    try:
        request.prompt = encode(tokenizer, for_template(messages, tokenizer), **options)
    except Exception as error:  # the template's own checks (jinja raise_exception, a missing key)
        raise invalid(
            f"the chat template rejected the messages: {error}", param="messages"
        ) from None
    request.thinking = thinking_of(tokenizer, request.prompt, thinking.block_budget())
    return request


def _chat_tools(tools: list) -> list:
    functions = []
    for i, tool in enumerate(tools):
        function = (
            tool.get("function")
            if isinstance(tool, dict) and tool.get("type") == "function"
            else None
        )
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                param=f"tools[{i}]",
            )
        functions.append(
            function_of(
                function.get("name"),
                function.get("parameters"),
                function.get("description"),
                f"tools[{i}]",
            )
        )
    return functions


def function_of(name, parameters, description, param: str) -> Function:
    """A ``tools.Function``, its fields checked (``param`` names the tool in an error)."""
    if not isinstance(name, str) or not name:
        raise invalid(f"{param} needs a 'name'", param=param)
    if parameters is not None and not isinstance(parameters, dict):
        raise invalid(f"{param}: the parameters must be a JSON Schema object", param=param)
    return Function(
        name, parameters or {"type": "object"}, description if isinstance(description, str) else ""
    )


def tool_choice(choice, functions: list, name_of: Callable, shape: str) -> str:
    """OpenAI's ``tool_choice``: "none", "auto" (also when absent), "required", or a named function,
    whose name ``name_of`` reads from the API's object (``shape``: that object, for the error)."""
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        if choice == "required" and not functions:
            raise invalid("'tool_choice' needs 'tools'", param="tool_choice")
        return choice
    name = name_of(choice) if isinstance(choice, dict) else None
    return named_choice(
        name, functions, f"'tool_choice' must be 'none', 'auto', 'required' or {shape}"
    )


def named_choice(name, functions: list, message: str) -> str:
    if not functions:
        raise invalid("'tool_choice' needs 'tools'", param="tool_choice")
    if name not in {f.name for f in functions}:
        raise invalid(message, param="tool_choice")
    return name


def response_schema(response_format: dict, param: str) -> Optional[str]:
    """JSON text of the schema a response format asks for, or None (plain text)."""
    _known_keys(response_format, {"type", "json_schema"}, param)
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise invalid(
                f"{param}.json_schema must be {{'name': ..., 'schema': {{...}}}}", param=param
            )
        _known_keys(spec, {"name", "schema", "strict", "description"}, f"{param}.json_schema")
        return json.dumps(spec.get("schema", {}))  # the engine compiles each distinct schema once
    raise invalid(f"{param}.type must be 'text', 'json_object' or 'json_schema'", param=param)


def _known_keys(value: dict, known: set, where: str):
    unknown = sorted(set(value) - known)
    if unknown:
        raise invalid(f"unrecognized argument {where}.{unknown[0]}", param=where)


def _top_logprobs(body: dict, name: str) -> Optional[int]:
    top = typed(body, name, (int,), None, "an integer")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid(f"'{name}' must be between 0 and {MAX_TOP_LOGPROBS}", param=name)
    return top


def parse_completion(
    body: dict, tokenizer, model_id: str, default_max_tokens: int
) -> GenerationRequest:
    """A /v1/completions body: the prompt is raw text (no chat template) or token ids."""
    max_tokens = typed(body, "max_tokens", (int,), None, "an integer")
    request = _common(body, COMPLETION_FIELDS, model_id, max_tokens, default_max_tokens, tokenizer)
    request.logprobs = _top_logprobs(body, "logprobs")  # the legacy form: the number of top tokens
    for name, default in (("echo", False), ("suffix", None), ("best_of", 1)):
        if body.get(name, default) not in (default, None):
            raise invalid(f"'{name}' is not supported", param=name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        request.prompt = tokenizer.encode(prompt)
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        request.prompt = prompt
    else:
        raise invalid(
            "'prompt' must be a non-empty string or list of token ids (one prompt)", param="prompt"
        )
    return request


def check_prompt(request: GenerationRequest, context_length: Optional[int], vocab_size: int):
    """Refuse prompts the model cannot take; cap max_tokens at what is left of the context."""
    if not all(0 <= t < vocab_size for t in request.prompt):
        raise invalid(f"token ids must be in [0, {vocab_size})", param="prompt")
    if not all(0 <= t < vocab_size for t in request.processors.get("logit_bias", ())):
        raise invalid(f"'logit_bias' token ids must be in [0, {vocab_size})", param="logit_bias")
    if context_length is not None:
        if len(request.prompt) + 1 > context_length:
            raise invalid(
                f"the prompt has {len(request.prompt)} tokens; "
                f"the model's context is {context_length} tokens",
                param="messages",
                code="context_length_exceeded",
            )
        request.max_tokens = min(request.max_tokens, context_length - len(request.prompt))
