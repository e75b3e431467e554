"""GPT-OSS's harmony format: analysis is reasoning, final the answer, a commentary message to a
function a tool call (server/harmony.py), in every API. Driven on text with the tiny harmony
tokenizer (tests/test_thinking.py): the oracle is what its template, written as GPT-OSS's is, writes
for a call."""

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.anthropic_input import parse_messages
from server.anthropic_output import MessagesFormat
from server.formats import ChatFormat, Reasoning
from server.harmony import chat_tool_syntax
from server.job import Outcome
from server.protocol import parse_chat
from server.responses_input import ResponseStore, parse_responses
from server.responses_output import ResponsesFormat
from server.tools import Call, Function, ToolUse, split
from tests.helpers import stop
from tests.test_server_tiny import start
from tests.tiny_server import harmony_tokenizer

TOKENIZER = harmony_tokenizer()
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
PARIS = Call("get_weather", '{"city": "Paris"}')
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}'
)
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"


def reader():
    return ToolUse(
        [Function("get_weather", WEATHER)], "auto", syntax=chat_tool_syntax(TOKENIZER)
    ).reader()


def test_the_call_the_template_writes_reads_back_as_a_call():
    assert chat_tool_syntax(TOKENIZER).name == "harmony"
    user = [{"role": "user", "content": "Weather in Paris?"}]
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    prompt = TOKENIZER.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    whole = TOKENIZER.apply_chat_template(
        user + [{"role": "assistant", "content": "", "tool_calls": [call]}], tokenize=False
    )
    # the generation prompt is <|start|>assistant; the recipient follows it
    assert whole.startswith(prompt)
    written = whole[len(prompt) :]
    assert written.startswith(" to=functions.get_weather<|channel|>commentary json<|message|>")
    assert split(reader(), written) == ("", [PARIS])
    assert split(reader(), "<|start|>assistant" + written) == ("", [PARIS])


def test_channels_read_as_text_calls_or_nothing():
    assert split(reader(), CALL + "<|call|>") == ("", [PARIS])
    # <|call|> is an EOS token: the stop leaves it out
    assert split(reader(), CALL) == ("", [PARIS])
    assert split(reader(), PREAMBLE + CALL) == ("Let me check.", [PARIS])
    assert split(reader(), "<|channel|>final<|message|>Sunny <|end|>") == ("Sunny", [])
    # the closing already opened final
    assert split(reader(), "Sunny, 3 < 4") == ("Sunny, 3 < 4", [])
    assert split(reader(), "to") == ("to", [])
    assert split(reader(), CALL[:-4]) == ("", [])  # cut short by max_tokens: no call
    assert split(reader(), "<|start|>assistant<|channel|>commen") == ("", [])  # a header cut short
    assert split(reader(), ANALYSIS + "<|start|>assistant<|channel|>final<|message|>ok") == (
        "ok",
        [],
    )


WHOLE = ANALYSIS + PREAMBLE + CALL


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=60))
def test_streamed_pieces_give_the_whole_and_never_show_markup(cuts):
    chat = parse_chat(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [
                {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
            ],
        },
        TOKENIZER,
        "m",
        32,
    )
    form, items, start = ChatFormat("m", chat), [], 0
    for cut in cuts:
        items += form.read(WHOLE[start : start + cut])
        start += cut
    items += form.read(WHOLE[start:], finish=True)
    assert (
        "".join(i.text for i in items if isinstance(i, Reasoning)) == "The user wants the weather."
    )
    texts = [i for i in items if isinstance(i, str)]
    assert "".join(texts) == "Let me check." and not any("<|" in t for t in texts)
    assert [i for i in items if isinstance(i, Call)] == [PARIS]


def outcome(text: str) -> Outcome:
    return Outcome(text, "stop", prompt_tokens=5, completion_tokens=20, cached_tokens=0)


def test_every_api_gives_the_call_and_the_reasoning():
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    hi = [{"role": "user", "content": "hi"}]
    chat = ChatFormat(
        "m", parse_chat({"model": "m", "messages": hi, "tools": [tool]}, TOKENIZER, "m", 32)
    )
    message = chat.full(outcome(ANALYSIS + CALL))["choices"][0]["message"]
    assert message["reasoning"] == "The user wants the weather." and message["content"] is None
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ] == [("get_weather", {"city": "Paris"})]
    messages = parse_messages(
        {
            "model": "m",
            "max_tokens": 32,
            "messages": hi,
            "tools": [{"name": "get_weather", "input_schema": WEATHER}],
        },
        TOKENIZER,
        "m",
        32,
    )
    blocks = MessagesFormat("m", messages).full(outcome(ANALYSIS + CALL))["content"]
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"] and blocks[1]["input"] == {
        "city": "Paris"
    }
    store = ResponseStore(4)
    responses = parse_responses(
        {
            "model": "m",
            "input": "hi",
            "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
        },
        TOKENIZER,
        "m",
        32,
        store,
    )
    output = ResponsesFormat("m", responses, store).full(outcome(ANALYSIS + CALL))["output"]
    assert [item["type"] for item in output] == ["reasoning", "function_call"]
    assert output[1]["name"] == "get_weather" and json.loads(output[1]["arguments"]) == {
        "city": "Paris"
    }


def test_without_tools_the_final_channel_header_is_not_the_answer():
    request = parse_chat(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, TOKENIZER, "m", 32
    )
    message = ChatFormat("m", request).full(outcome("<|channel|>final<|message|>Hello<|end|>"))[
        "choices"
    ][0]["message"]
    assert message["content"] == "Hello"


def test_a_forced_call_is_bare_json_in_the_final_channel():
    forced = ToolUse(
        [Function("get_weather", WEATHER)], "required", syntax=chat_tool_syntax(TOKENIZER)
    )
    assert forced.syntax is None and forced.grammar() is None and forced.json_schema() is not None
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    request = parse_chat(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [tool],
            "tool_choice": "required",
        },
        TOKENIZER,
        "m",
        32,
    )
    text = (
        ANALYSIS + "<|start|>assistant<|channel|>final"
        '<|message|>{"name": "get_weather", "arguments": {"city": "Paris"}}'
    )
    message = ChatFormat("m", request).full(outcome(text))["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "get_weather" and message["reasoning"]


@pytest.mark.slow
def test_a_harmony_model_through_the_client(tmp_path):
    """The tiny random model with the harmony template: a forced call after a bounded analysis
    channel comes back as a call, and no channel header shows in any text."""
    from openai import OpenAI

    process, url, log = start(tmp_path, "--harmony")
    try:
        client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
        called = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=120,
            temperature=0,
            tools=tools,
            tool_choice="required",
            extra_body={"thinking_token_budget": 3},
        )
        message = called.choices[0].message
        assert message.tool_calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), WEATHER)
        free = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=40,
            temperature=0,
            tools=tools,
        )
        content = free.choices[0].message.content or ""
        # each opens a header, never text
        assert "<|channel|>" not in content and "<|start|>" not in content
    finally:
        stop(process)
