"""OpenAI chat messages: each checked as a request gives it (``chat_message``), and all shown as a
chat template takes them (``for_template``). Anthropic Messages and OpenAI Responses turn their
input into these messages first (anthropic_input.py, responses_input.py).
"""

import json

from server.request import invalid


def chat_message(message, index: int) -> dict:
    """``messages[index]`` checked: its content as text (text parts joined), its reasoning as
    ``reasoning_content``, the name templates read."""
    param = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise invalid(f"{param} must be an object with a 'role'", param=param)
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text is understood
        if not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            raise invalid(f"{param}.content: only text parts are supported", param=param)
        content = "".join(p["text"] for p in content)
    calls = message.get("tool_calls")
    if calls is not None and not (
        isinstance(calls, list)
        and all(
            isinstance(c, dict)
            and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str)
            for c in calls
        )
    ):
        raise invalid(
            f"{param}.tool_calls must be a list of "
            "{'function': {'name': ..., 'arguments': ...}}",
            param=param,
        )
    if content is None and calls:
        content = ""
    if not isinstance(content, str):
        raise invalid(f"{param}.content must be a string or a list of text parts", param=param)
    reasoning = message.get("reasoning", message.get("reasoning_content"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise invalid(f"{param}.reasoning must be a string", param=param)
    message = {key: value for key, value in message.items() if key != "reasoning"}
    return {
        **message,
        "content": content,
        **({"reasoning_content": reasoning} if reasoning else {}),
    }


def for_template(messages: list, tokenizer) -> list:
    """Messages as a template takes them: a call's arguments as an object (templates write them with
    ``tojson``); a template that writes no calls sees each as its JSON in the content."""
    # as text.encode: not every tokenizer has one
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    shown = []
    for message in messages:
        calls = [
            {
                **call,
                "function": {
                    **call["function"],
                    "arguments": _arguments(call["function"]["arguments"]),
                },
            }
            for call in message.get("tool_calls") or []
        ]
        if calls and "tool_calls" not in template:
            written = "\n".join(
                json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                    separators=(",", ":"),
                    ensure_ascii=False,
                )
                for c in calls
            )
            message = {
                **message,
                "content": "\n".join(filter(None, [message.get("content"), written])),
            }
        shown.append({**message, "tool_calls": calls} if calls else message)
    return shown


def _arguments(arguments):
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:  # shown as the text it is
        return arguments
