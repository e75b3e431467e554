"""Anthropic's Messages and OpenAI's Responses next to chat completions, through the official
``anthropic`` and ``openai`` clients, on the tiny random model (tests/tiny_server.py) with a
Hermes tool-call template. Greedy throughout (the anthropic client sets temperature through
extra_body), so an answer alone, streamed or batched with others is the same text.

Fast tests read request bodies without a server; the slow ones start tiny servers (seconds each).
"""

import asyncio
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import jsonschema
import pytest

from server.request import ApiError
from tests import tiny_server
from tests.helpers import stop
from tests.test_server_tiny import start

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
ANTHROPIC_TOOLS = [
    {"name": "get_weather", "description": "Current weather", "input_schema": WEATHER_SCHEMA}
]
RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather",
        "parameters": WEATHER_SCHEMA,
    }
]
USER_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
GREEDY = {"temperature": 0}
HERMES = tiny_server.tokenizer(hermes=True)


# ---- request bodies, without a server ------------------------------------------------------------


def test_a_messages_body_becomes_the_chat_a_template_renders():
    from server.anthropic_input import parse_messages

    body = {
        "model": "tiny",
        "max_tokens": 5,
        "system": [{"type": "text", "text": "Be brief."}],
        "metadata": {"user_id": "u"},
        "tools": ANTHROPIC_TOOLS,
        "tool_choice": {"type": "auto"},
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "...", "signature": "s"},
                    {"type": "text", "text": "Let me look."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Oslo"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "3 C"}],
                    },
                    {
                        "type": "text",
                        "text": "And tomorrow?",
                        "cache_control": {"type": "ephemeral"},
                    },
                ],
            },
        ],
    }
    request = parse_messages(body, HERMES, "tiny", 64)
    assert request.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "...",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "3 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    rendered = HERMES.decode(request.prompt)
    assert (
        "Let me "
        'look.<tool_call>\n{"name": "get_weather", "arguments": {"city": '
        '"Oslo"}}\n</tool_call>' in rendered
    )
    assert rendered.startswith("tools: get_weather\n") and request.tools.choice == "auto"
    # Anthropic's default temperature
    assert request.tool_grammar is not None and request.sampling.temp == 1.0
    counted = parse_messages(
        {k: v for k, v in body.items() if k != "max_tokens"}, HERMES, "tiny", 64, counting=True
    )
    assert counted.prompt == request.prompt


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"temperature": 1.5}, "'temperature' must be between 0.0 and 1.0"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "'image' blocks are not supported",
        ),
        ({"tool_choice": {"type": "any"}, "tools": []}, "'any' needs tools"),
        ({"tool_choice": {"type": "tool", "name": "nope"}}, "'name' must be one of the tools"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "only custom tools"),
        ({"stop_sequences": [""]}, "stop_sequences"),
    ],
)
def test_bad_messages_bodies_are_400_in_one_line(change, fragment):
    from server.anthropic_input import parse_messages
    from server.anthropic_output import anthropic_error

    body = {
        "model": "tiny",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": ANTHROPIC_TOOLS,
        **change,
    }
    with pytest.raises(ApiError) as caught:
        parse_messages({k: v for k, v in body.items() if v is not None}, HERMES, "tiny", 64)
    assert (
        caught.value.status == 400
        and fragment in caught.value.message
        and "\n" not in caught.value.message
    )
    assert anthropic_error(caught.value) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": caught.value.message},
    }


def test_responses_input_items_become_chat_messages():
    from server.responses_input import ResponseStore, parse_responses

    body = {
        "model": "tiny",
        "instructions": "Be brief.",
        "tools": RESPONSES_TOOLS,
        "store": True,
        "reasoning": {"effort": "low"},
        "include": [],
        "parallel_tool_calls": False,
        "input": [
            {"role": "developer", "content": "Use metric units."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Oslo?"}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "3 C"},
        ],
    }
    request = parse_responses(body, HERMES, "tiny", 64, ResponseStore(4))
    assert request.messages == [  # what a follow-up builds on: no instructions
        {"role": "system", "content": "Use metric units."},
        {"role": "user", "content": "Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "3 C"},
    ]
    assert HERMES.decode(request.prompt).startswith(
        "tools: get_weather\nsystem: Be brief.\nsystem: Use metric"
    )
    assert not request.tools.parallel and request.max_tokens == 64
    for change, fragment in (
        ({"input": []}, "'input' must be"),
        ({"tools": [{"type": "web_search"}]}, "function tools"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"conversation": "c"}, "unrecognized request argument: conversation"),
    ):
        with pytest.raises(ApiError, match=re.escape(fragment)):
            parse_responses({**body, **change}, HERMES, "tiny", 64, ResponseStore(4))
    with pytest.raises(ApiError) as caught:
        parse_responses(
            {**body, "previous_response_id": "resp_gone"}, HERMES, "tiny", 64, ResponseStore(4)
        )
    assert caught.value.status == 404 and caught.value.code == "previous_response_not_found"


def parsers() -> dict:
    """Each API's parser and a minimal body of it."""
    from server.anthropic_input import parse_messages
    from server.protocol import parse_chat, parse_completion
    from server.responses_input import ResponseStore, parse_responses

    hi = [{"role": "user", "content": "hi"}]
    return {
        "chat": (parse_chat, {"messages": hi}),
        "completions": (parse_completion, {"prompt": "hi"}),
        "responses": (lambda *a: parse_responses(*a, ResponseStore(4)), {"input": "hi"}),
        "messages": (parse_messages, {"messages": hi, "max_tokens": 5}),
    }


# Fields that change nothing in the output: accepted, and the request is the one without them.
BOOKKEEPING = {
    "chat": {
        "user": "u1",
        "store": True,
        "metadata": {"a": "b"},
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "modalities": ["text"],
    },
    "completions": {"user": "u1", "metadata": {"a": "b"}, "echo": False, "best_of": 1},
    "responses": {
        "metadata": {"a": "b"},
        "user": "u1",
        "prompt_cache_key": "k",
        "truncation": "disabled",
        "background": False,
        "include": ["web_search_call.results", "file_search_call.results"],
        "stream_options": {"include_obfuscation": False},
        "text": {"verbosity": "medium"},
    },
    "messages": {"metadata": {"user_id": "u1"}, "service_tier": "auto", "mcp_servers": []},
}


@pytest.mark.parametrize("api", BOOKKEEPING)
def test_fields_that_change_nothing_are_accepted_and_change_nothing(api):
    parse, body = parsers()[api]
    plain = parse({"model": "tiny", **body}, HERMES, "tiny", 64)
    with_them = parse({"model": "tiny", **body, **BOOKKEEPING[api]}, HERMES, "tiny", 64)
    assert with_them == plain


@pytest.mark.parametrize(
    "api, change, param",
    [
        ("chat", {"modalities": ["text", "audio"]}, "modalities"),
        ("chat", {"verbosity": "low"}, "verbosity"),
        ("chat", {"stream_options": {"include_usage": True}, "audio": {}}, "audio"),
        ("completions", {"echo": True}, "echo"),
        ("completions", {"suffix": "end"}, "suffix"),
        ("responses", {"truncation": "auto"}, "truncation"),
        ("responses", {"background": True}, "background"),
        ("responses", {"include": ["message.output_text.logprobs"]}, "include"),
        ("responses", {"text": {"verbosity": "low"}}, "text"),
        ("responses", {"top_logprobs": 2}, "top_logprobs"),
        ("messages", {"container": "container_1"}, "container"),
        (
            "messages",
            {"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]},
            "mcp_servers",
        ),
        (
            "messages",
            {"context_management": {"edits": [{"type": "clear_tool_uses"}]}},
            "context_management",
        ),
        ("messages", {"output_format": {"type": "json_schema", "schema": {}}}, "output_format"),
        ("messages", {"n": 2}, "n"),
    ],
)
def test_a_field_that_would_change_the_output_and_is_not_honoured_is_a_400_naming_it(
    api, change, param
):
    parse, body = parsers()[api]
    with pytest.raises(ApiError) as caught:
        parse({"model": "tiny", **body, **change}, HERMES, "tiny", 64)
    assert caught.value.status == 400 and caught.value.param == param
    assert param in caught.value.message and "\n" not in caught.value.message


def test_a_quiet_stream_pings_and_then_goes_on():
    """Anthropic's stream sends a ping after MessagesFormat.ping_s without events (a long
    prefill)."""
    from server.anthropic_output import MessagesFormat
    from server.app import events
    from server.job import Outcome
    from server.request import GenerationRequest

    async def run():
        job = SimpleNamespace(events=asyncio.Queue())
        fmt = MessagesFormat("tiny", GenerationRequest(prompt=[1, 2, 3], max_tokens=4))
        fmt.ping_s = 0.05
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, job.events.put_nowait, ("text", ("Hi", None)))
        loop.call_later(0.35, job.events.put_nowait, ("done", Outcome("Hi", "stop", 3, 1, 0)))
        return [event async for event in events(job, fmt, 0)]

    kinds = [re.match(r"event: (\w+)", event).group(1) for event in asyncio.run(run())]
    assert kinds[0] == "message_start" and kinds.count("ping") >= 2
    assert [k for k in kinds if k != "ping"] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


# ---- through the SDKs
# --------------------------------------------------------------------------------


def post(base_url: str, path: str, body):
    """A raw POST (stdlib http.client), for bad JSON and hanging up mid-stream: the response."""
    from http.client import HTTPConnection
    from urllib.parse import urlsplit

    url = urlsplit(base_url)
    connection = HTTPConnection(url.hostname, url.port, timeout=60)
    connection.request(
        "POST",
        url.path + path,
        body if isinstance(body, bytes) else json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    return connection.getresponse()


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    process, url, log = start(tmp_path_factory.mktemp("hermes"), "--hermes", "--max-queue", "16")
    yield process, url, log
    stop(process)


def clients(server) -> tuple:
    import anthropic
    import openai

    return (
        anthropic.Anthropic(
            base_url=server[1].removesuffix("/v1"), api_key="none", max_retries=0, timeout=60
        ),
        openai.OpenAI(base_url=server[1], api_key="none", max_retries=0, timeout=60),
    )


ANTHROPIC_ORDER = re.compile(
    r"message_start (ping )*(content_block_start (content_block_delta |ping )*"
    r"content_block_stop (ping )*)*message_delta message_stop "
)
RESPONSES_ORDER = re.compile(
    r"response\.created response\.in_progress (response\.output_item\.added "
    r"(response\.content_part\.added (response\.output_text\.delta )*"
    r"response\.output_text\.done "
    r"response\.content_part\.done |response\.function_call_arguments\.delta "
    r"response\.function_call_arguments\.done )response\.output_item\.done )*"
    r"response\.completed "
)


@pytest.mark.slow
def test_messages_text_streamed_or_not_and_count_tokens(hermes):
    anthropic_client, _ = clients(hermes)
    request = dict(
        model="tiny",
        max_tokens=12,
        messages=[{"role": "user", "content": "ab 12 ab"}],
        extra_body=GREEDY,
    )
    whole = anthropic_client.messages.create(**request)
    assert (
        whole.stop_reason == "max_tokens"
        and whole.usage.output_tokens == 12
        and whole.content[0].type == "text"
    )
    counted = anthropic_client.messages.count_tokens(
        model="tiny", messages=request["messages"]
    ).input_tokens
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == counted
    events = list(anthropic_client.messages.create(**request, stream=True))
    assert ANTHROPIC_ORDER.fullmatch("".join(f"{e.type} " for e in events))
    assert (
        events[0].message.usage.input_tokens + events[0].message.usage.cache_read_input_tokens
        == counted
    )
    assert (
        "".join(e.delta.text for e in events if e.type == "content_block_delta")
        == whole.content[0].text
    )
    with anthropic_client.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    # the same prompt again: all but its last token
    assert final.usage.cache_read_input_tokens >= counted - 1


@pytest.mark.slow
def test_messages_tool_round_trip(hermes):
    anthropic_client, _ = clients(hermes)
    question = [{"role": "user", "content": "Weather in Paris?"}]
    first = anthropic_client.messages.create(
        model="tiny",
        max_tokens=200,
        messages=question,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    )
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"]
    call = first.content[0]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    with anthropic_client.messages.stream(
        model="tiny",
        max_tokens=200,
        messages=question,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    ) as stream:
        # the helper's events, raw ones included
        kinds = "".join(f"{event.type} " for event in stream)
        streamed = stream.get_final_message()
    assert (
        "input_json" in kinds
        and "<tool_call>" not in kinds
        and streamed.content[0].input == call.input
    )
    history = question + [
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "18 C and sunny"}
            ],
        },
    ]
    answer = anthropic_client.messages.create(
        model="tiny", max_tokens=8, messages=history, tools=ANTHROPIC_TOOLS, extra_body=GREEDY
    )
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    # The first turn's prompt came from the prompt cache, up to the token before the answer.
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert answer.usage.cache_read_input_tokens >= first_prompt - 1
    assert (
        answer.usage.input_tokens + answer.usage.cache_read_input_tokens
        == anthropic_client.messages.count_tokens(
            model="tiny", messages=history, tools=ANTHROPIC_TOOLS
        ).input_tokens
    )


@pytest.mark.slow
def test_responses_text_structured_output_and_event_order(hermes):
    _, openai_client = clients(hermes)
    whole = openai_client.responses.create(
        model="tiny", input="ab 12", max_output_tokens=10, temperature=0
    )
    assert whole.status == "incomplete" and whole.usage.output_tokens == 10 and whole.output_text
    events = list(
        openai_client.responses.create(
            model="tiny", input="ab 12", max_output_tokens=10, temperature=0, stream=True
        )
    )
    assert RESPONSES_ORDER.fullmatch("".join(f"{e.type} " for e in events))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == whole.output_text
    structured = openai_client.responses.create(
        model="tiny",
        input="A user as JSON.",
        max_output_tokens=80,
        temperature=0,
        text={
            "format": {"type": "json_schema", "name": "user", "schema": USER_SCHEMA, "strict": True}
        },
    )
    assert structured.status == "completed"
    jsonschema.validate(json.loads(structured.output_text), USER_SCHEMA)


@pytest.mark.slow
def test_responses_tool_round_trip_with_and_without_previous_response_id(hermes):
    _, openai_client = clients(hermes)
    first = openai_client.responses.create(
        model="tiny",
        input="Weather in Oslo?",
        tools=RESPONSES_TOOLS,
        tool_choice="required",
        max_output_tokens=200,
        temperature=0,
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    with openai_client.responses.stream(
        model="tiny",
        input="Weather in Oslo?",
        tools=RESPONSES_TOOLS,
        tool_choice="required",
        max_output_tokens=200,
        temperature=0,
    ) as stream:
        kinds = "".join(f"{event.type} " for event in stream)
        streamed = stream.get_final_response()
    assert RESPONSES_ORDER.fullmatch(kinds) and streamed.output[0].arguments == call.arguments
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "3 C"}
    follow_up = openai_client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input=[result],
        tools=RESPONSES_TOOLS,
        max_output_tokens=8,
        temperature=0,
    )
    resent = openai_client.responses.create(
        model="tiny",
        tools=RESPONSES_TOOLS,
        max_output_tokens=8,
        temperature=0,
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            result,
        ],
    )
    assert (
        follow_up.output_text == resent.output_text
        and follow_up.usage.input_tokens == resent.usage.input_tokens
    )
    assert follow_up.usage.input_tokens_details.cached_tokens > 0


@pytest.mark.slow
def test_errors_come_in_each_apis_shape_and_the_server_keeps_serving(hermes):
    import anthropic
    import openai

    anthropic_client, openai_client = clients(hermes)
    with pytest.raises(anthropic.NotFoundError) as caught:
        anthropic_client.messages.create(
            model="claude-x", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert (
        caught.value.body["type"] == "error"
        and caught.value.body["error"]["type"] == "not_found_error"
    )
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client.messages.create(
            model="tiny",
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        }
                    ],
                }
            ],
        )
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    raw = post(
        hermes[1],
        "/messages?beta=true",
        {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert raw.status == 200 and json.loads(raw.read())["type"] == "message"  # Claude Code's query
    raw = post(hermes[1], "/messages", b"{bad")
    assert raw.status == 400 and json.loads(raw.read())["type"] == "error"
    raw = post(
        hermes[1], "/messages", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert raw.status == 400 and "max_tokens" in json.loads(raw.read())["error"]["message"]
    with pytest.raises(openai.NotFoundError) as caught:
        openai_client.responses.create(model="tiny", input="hi", previous_response_id="resp_gone")
    assert caught.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError):
        openai_client.responses.create(model="tiny", input="hi", tools=[{"type": "web_search"}])
    assert openai_client.models.list().data and "Traceback" not in hermes[2].read_text()


@pytest.mark.slow
def test_the_three_apis_at_once_each_get_what_they_get_alone(hermes):
    """Chat completions (a forced call), Messages and Responses sent together share one batch."""
    anthropic_client, openai_client = clients(hermes)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}

    def ask(index: int):
        if index % 3 == 0:
            answer = openai_client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": f"Weather {index}?"}],
                tools=[tool],
                tool_choice="required",
                max_tokens=200,
                temperature=0,
            )
            return answer.choices[0].message.tool_calls[0].function.arguments
        if index % 3 == 1:
            return (
                anthropic_client.messages.create(
                    model="tiny",
                    max_tokens=16,
                    extra_body=GREEDY,
                    messages=[{"role": "user", "content": f"ab {index} ab"}],
                )
                .content[0]
                .text
            )
        return openai_client.responses.create(
            model="tiny", input=f"12 {index} 12", max_output_tokens=16, temperature=0
        ).output_text

    alone = [ask(index) for index in range(6)]
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(ask, range(6)))
    assert together == alone and all(alone)


@pytest.mark.slow
def test_a_client_that_hangs_up_mid_stream_frees_its_row(tmp_path):
    """One row and one queue place: a stream left after its first events must not hold the row,
    or of the next two requests one would wait and the other be refused (529)."""
    process, url, log = start(tmp_path, "--max-batch", "1", "--max-queue", "1")
    try:
        anthropic_client, openai_client = clients((process, url, log))
        # greedy: no early EOS
        body = {
            "model": "tiny",
            "max_tokens": 4000,
            "stream": True,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Write a long story."}],
        }
        for path, api_body in (
            ("/messages", body),
            (
                "/responses",
                {
                    "model": "tiny",
                    "input": "Write a long story.",
                    "max_output_tokens": 4000,
                    "stream": True,
                    "temperature": 0,
                },
            ),
        ):
            response = post(url, path, api_body)
            assert response.status == 200 and response.readline().startswith(b"event: ")
            response.close()  # and the connection with it
            time.sleep(1)  # the server notices the closed connection
            with ThreadPoolExecutor(2) as pool:
                answers = list(
                    pool.map(
                        lambda i: anthropic_client.messages.create(
                            model="tiny",
                            max_tokens=2,
                            messages=[{"role": "user", "content": f"hi {i}"}],
                        ),
                        range(2),
                    )
                )
            # both served (neither refused nor left waiting), whether or not one ends early
            assert all(1 <= a.usage.output_tokens <= 2 for a in answers), answers
            assert {a.stop_reason for a in answers} <= {"max_tokens", "end_turn"}
    finally:
        stop(process)
    assert "Traceback" not in log.read_text()
