"""Thinking models in every API: reasoning kept apart, budgets, effort levels, constraints after the
think block, through the official ``openai`` and ``anthropic`` clients on the tiny random model with
a template that opens the block (tests/tiny_server.py --thinking opens). Greedy throughout.

Fast tests read request bodies without a server; the slow ones start one tiny server."""

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from constrained.thinking import ANSWER, START, THINKING, Thinking
from server.anthropic_input import parse_messages
from server.protocol import parse_chat
from server.reasoning import EFFORT_BUDGETS, parse_effort_budgets
from server.request import ApiError
from server.responses_input import ResponseStore, parse_responses
from tests import tiny_server
from tests.helpers import stop
from tests.test_server_tiny import start

OPENS = tiny_server.tokenizer(hermes=True, thinking="opens")
OPTIONAL = tiny_server.tokenizer(thinking="optional")
PLAIN = tiny_server.tokenizer()
HI = [{"role": "user", "content": "hi"}]
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}


def chat(tokenizer=OPENS, **body):
    return parse_chat({"model": "tiny", "messages": HI, **body}, tokenizer, "tiny", 32)


# ---- request bodies, without a server ------------------------------------------------------------


def test_chat_effort_budget_and_template_options():
    # the template's default
    assert chat().thinking.phase == THINKING and chat().thinking.budget is None
    assert chat(reasoning_effort="low").thinking.budget == EFFORT_BUDGETS["low"]
    # the explicit budget wins
    assert chat(reasoning_effort="low", thinking_token_budget=7).thinking.budget == 7
    off = chat(reasoning_effort="none")
    assert off.thinking.phase == ANSWER and OPENS.decode(off.prompt).endswith(
        "<think>\n\n</think>\n\n"
    )
    assert chat(chat_template_kwargs={"enable_thinking": False}).prompt == off.prompt
    assert chat(OPTIONAL).thinking.phase == START  # Qwen3's template leaves the block to the model
    # no think markers: answered as it is
    assert chat(PLAIN, reasoning_effort="high").thinking is None


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"thinking_token_budget": 0}, "'thinking_token_budget' must be a positive integer"),
        ({"thinking_token_budget": True}, "'thinking_token_budget' must be a positive integer"),
        ({"reasoning_effort": "extreme"}, "'reasoning_effort' must be one of none, minimal, low"),
        ({"chat_template_kwargs": []}, "'chat_template_kwargs' must be an object"),
    ],
)
def test_bad_chat_thinking_fields_are_400(body, fragment):
    with pytest.raises(ApiError) as error:
        chat(**body)
    assert error.value.status == 400 and fragment in error.value.message


def test_history_reasoning_reaches_the_template():
    history = HI + [
        {"role": "assistant", "content": "Hello", "reasoning": "greet back"},
        {"role": "user", "content": "?"},
    ]
    assert chat(messages=history).messages[1]["reasoning_content"] == "greet back"
    body = {
        "model": "tiny",
        "max_tokens": 5,
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "greet back", "signature": "s"},
                    {"type": "text", "text": "Hello"},
                ],
            },
            {"role": "user", "content": "?"},
        ],
    }
    assert parse_messages(body, OPENS, "tiny", 8).messages[1] == {
        "role": "assistant",
        "content": "Hello",
        "reasoning_content": "greet back",
    }
    items = [
        {"type": "message", "role": "user", "content": "hi"},
        {
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "greet back"}],
        },
        {"type": "message", "role": "assistant", "content": "Hello"},
        {"type": "message", "role": "user", "content": "?"},
    ]
    request = parse_responses({"model": "tiny", "input": items}, OPENS, "tiny", 8, ResponseStore(4))
    assert request.messages[1]["reasoning_content"] == "greet back"


@pytest.mark.parametrize(
    "thinking, effort, expected",
    [
        ({"type": "enabled", "budget_tokens": 3}, None, (THINKING, 3)),
        ({"type": "disabled"}, None, (ANSWER, 0)),
        ({"type": "adaptive"}, "medium", (THINKING, EFFORT_BUDGETS["medium"])),
        (None, None, (THINKING, None)),
    ],
)
def test_messages_thinking_and_effort(thinking, effort, expected):
    body = {
        "model": "tiny",
        "max_tokens": 5,
        "messages": HI,
        **({"thinking": thinking} if thinking else {}),
        **({"output_config": {"effort": effort}} if effort else {}),
    }
    request = parse_messages(body, OPENS, "tiny", 8)
    assert (request.thinking.phase, request.thinking.budget) == expected


@pytest.mark.parametrize(
    "thinking", [{"type": "enabled"}, {"type": "enabled", "budget_tokens": 0}, {"type": "on"}]
)
def test_bad_messages_thinking_is_400(thinking):
    with pytest.raises(ApiError) as error:
        parse_messages(
            {"model": "tiny", "max_tokens": 5, "messages": HI, "thinking": thinking},
            OPENS,
            "tiny",
            8,
        )
    assert error.value.status == 400 and "thinking" in error.value.message


def test_responses_reasoning_effort():
    request = parse_responses(
        {"model": "tiny", "input": "hi", "reasoning": {"effort": "minimal"}},
        OPENS,
        "tiny",
        8,
        ResponseStore(4),
        effort_budgets=parse_effort_budgets("minimal=9"),
    )
    assert request.thinking.budget == 9


def test_the_effort_table_flag():
    from cli import CliError
    from server.__main__ import build_parser, validate

    assert (
        parse_effort_budgets("low=5, high=none")["low"] == 5
        and parse_effort_budgets("high=none")["high"] is None
    )
    for bad in ("low", "low=0", "none=5", "low=x"):
        with pytest.raises(ValueError):
            parse_effort_budgets(bad)
    args = build_parser().parse_args(["--effort-budgets", "low=512,max=100000"])
    validate(args)
    assert args.effort_table == {**EFFORT_BUDGETS, "low": 512, "max": 100000}
    with pytest.raises(CliError, match="--effort-budgets 'low=0'"):
        validate(build_parser().parse_args(["--effort-budgets", "low=0"]))


THINKING_OPEN = chat().thinking


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from(
        ["\nplan it\n</think>\n\nThe answer", "</think>x", "a</thi", "\n\n", "<think>b</think>\n c"]
    ),
    st.lists(st.integers(0, 40), max_size=4),
    st.sampled_from([START, THINKING, ANSWER]),
)
def test_streamed_splitting_equals_the_whole(text, cuts, phase):
    thinking = Thinking(THINKING_OPEN.markers, phase)
    splitter, pieces = thinking.splitter(), []
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    for begin, end in zip(bounds, bounds[1:]):
        pieces += splitter.add(text[begin:end])
    pieces += splitter.finish()
    joined = tuple(
        "".join(t for kind, t in pieces if kind == wanted) for wanted in ("reasoning", "text")
    )
    assert joined == thinking.split(text)
    if phase == THINKING and "</think>" in text:
        assert joined[1] == text.split("</think>")[1].lstrip()


# ---- through the clients, on a tiny server -------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process, url, log = start(
        tmp_path_factory.mktemp("thinking"), "--thinking", "opens", "--hermes"
    )
    yield url
    stop(process)


def openai_client(url):
    from openai import OpenAI

    return OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)


def anthropic_client(url):
    import anthropic

    return anthropic.Anthropic(
        base_url=url.removesuffix("/v1"), api_key="none", max_retries=0, timeout=60
    )


def ask(url, max_tokens=30, **body):
    return openai_client(url).chat.completions.create(
        model="tiny", messages=HI, max_tokens=max_tokens, temperature=0, extra_body=body
    )


@pytest.mark.slow
def test_chat_reasoning_budget_and_stream(server):
    reply = ask(server, thinking_token_budget=5)
    message = reply.choices[0].message
    assert message.reasoning and message.reasoning_content == message.reasoning and message.content
    assert reply.usage.completion_tokens_details.reasoning_tokens == 5
    chunks = list(
        openai_client(server).chat.completions.create(
            model="tiny",
            messages=HI,
            max_tokens=30,
            temperature=0,
            stream=True,
            extra_body={"thinking_token_budget": 5},
        )
    )
    kinds = [
        ("reasoning" if getattr(c.choices[0].delta, "reasoning", None) else "content")
        for c in chunks
        if getattr(c.choices[0].delta, "reasoning", None) or c.choices[0].delta.content
    ]
    # every reasoning delta first
    assert kinds == sorted(kinds, key=lambda kind: kind != "reasoning")
    assert (
        "".join(getattr(c.choices[0].delta, "reasoning", None) or "" for c in chunks)
        == message.reasoning
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    off = ask(server, reasoning_effort="none")
    assert getattr(off.choices[0].message, "reasoning", None) is None
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.slow
def test_a_schema_and_a_forced_tool_start_after_the_reasoning(server):
    reply = openai_client(server).chat.completions.create(
        model="tiny",
        messages=HI,
        max_tokens=40,
        temperature=0,
        extra_body={"thinking_token_budget": 4},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
    )
    message = reply.choices[0].message
    assert message.reasoning and reply.usage.completion_tokens_details.reasoning_tokens == 4
    if reply.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(message.content), SCHEMA)
    else:  # cut by max_tokens: a prefix of JSON, written after the block
        assert message.content.startswith('{"a":')
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    called = openai_client(server).chat.completions.create(
        model="tiny",
        messages=HI,
        max_tokens=150,
        temperature=0,
        tools=tools,
        extra_body={"thinking_token_budget": 3},
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    call = called.choices[0].message.tool_calls[0]
    assert called.choices[0].message.reasoning and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


@pytest.mark.slow
def test_messages_thinking_blocks_and_stream(server):
    client = anthropic_client(server)
    options = dict(
        model="tiny",
        max_tokens=30,
        messages=HI,
        thinking={"type": "enabled", "budget_tokens": 4},
        extra_body={"temperature": 0},
    )
    message = client.messages.create(**options)
    thinking, text = message.content[0], message.content[1]
    assert thinking.type == "thinking" and text.type == "text" and thinking.thinking
    assert thinking.signature == hashlib.sha256(thinking.thinking.encode()).hexdigest()
    with client.messages.stream(**options) as stream:
        events = [
            (e.type, getattr(getattr(e, "delta", None), "type", None))
            for e in stream
            if e.type.startswith("content_block")
        ]
        final = stream.get_final_message()
    assert events[0] == ("content_block_start", None) and events[1] == (
        "content_block_delta",
        "thinking_delta",
    )
    signature = events.index(("content_block_delta", "signature_delta"))
    assert events[signature + 1] == ("content_block_stop", None)
    assert {kind for _, kind in events[:signature]} <= {None, "thinking_delta"}
    assert [block.model_dump(exclude={"parsed_output"}) for block in final.content] == [
        block.model_dump() for block in message.content
    ]
    off = client.messages.create(**{**options, "thinking": {"type": "disabled"}})
    assert [block.type for block in off.content] == ["text"]


@pytest.mark.slow
def test_responses_reasoning_item_and_stream(server):
    client = openai_client(server)
    response = client.responses.create(
        model="tiny",
        input="hi",
        max_output_tokens=30,
        temperature=0,
        extra_body={"thinking_token_budget": 3},
    )
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].type == "reasoning_text"
    assert message.type == "message" and response.usage.output_tokens_details.reasoning_tokens == 3
    events = list(
        client.responses.create(
            model="tiny",
            input="hi",
            max_output_tokens=30,
            temperature=0,
            stream=True,
            extra_body={"thinking_token_budget": 3},
        )
    )
    kinds = [e.type for e in events]
    assert kinds[2:5] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
    ]
    done = kinds.index("response.reasoning_text.done")
    assert kinds[done : done + 3] == [
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert events[done].text == reasoning.content[0].text
    assert events[-1].response.output[0].content == reasoning.content
    follow = client.responses.create(
        model="tiny",
        input="and?",
        max_output_tokens=5,
        temperature=0,
        previous_response_id=response.id,
        reasoning={"effort": "none"},
    )
    assert [item.type for item in follow.output] == ["message"]


@pytest.mark.slow
def test_opaque_reasoning_goes_back_and_forth_as_the_reasoning_text(server):
    """``include: ["reasoning.encrypted_content"]`` (a client that stores nothing, as Codex):
    the reasoning item carries its text opaquely, and an input item with only that text reads as
    one with the text in the clear (the next prompt's ``reasoning_content``)."""
    client = openai_client(server)
    options = dict(model="tiny", max_output_tokens=30, temperature=0)
    first = client.responses.create(
        input="hi",
        include=["reasoning.encrypted_content"],
        extra_body={"thinking_token_budget": 3},
        **options,
    )
    reasoning, message = first.output
    assert reasoning.encrypted_content
    from server.responses_input import _input_messages

    text = reasoning.content[0].text
    back = {"type": "reasoning", "summary": [], "encrypted_content": reasoning.encrypted_content}
    answer = {"role": "assistant", "content": message.content[0].text}
    chat = _input_messages([{"role": "user", "content": "hi"}, back, answer])
    assert chat[-1]["reasoning_content"] == text


@pytest.mark.slow
def test_a_batch_mixing_thinking_and_plain_rows_gives_each_row_its_answer_alone(server):
    asks = [
        {"thinking_token_budget": 2},
        {"reasoning_effort": "none"},
        {"thinking_token_budget": 9},
        {},
        {
            "thinking_token_budget": 4,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": SCHEMA},
            },
        },
    ]

    def answer(body):
        message = ask(server, 24, **body).choices[0].message
        return getattr(message, "reasoning", None), message.content

    alone = [answer(body) for body in asks]
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(answer, asks))
    assert together == alone
    assert [reasoning is not None for reasoning, _ in alone] == [True, False, True, True, True]


@pytest.mark.slow
def test_streamed_text_ends_as_decode_shows_it(server):
    """Cut inside a character (one token per byte of é): the stream and the answer end with U+FFFD,
    as decode."""
    client = openai_client(server)
    body = dict(
        model="tiny", prompt="x", max_tokens=3, temperature=0, extra_body={"guided_regex": "ééé"}
    )
    assert client.completions.create(**body).choices[0].text == "é\ufffd"
    assert (
        "".join(c.choices[0].text for c in client.completions.create(**body, stream=True))
        == "é\ufffd"
    )
