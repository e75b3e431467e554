"""Tool calls in the model's own syntax (server/tools.py), without a server.

The oracle is each family's chat template: what it writes for a call must be what the grammar
accepts and what the reader gives back, and a call against the tool's schema must be refused.
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.tools import Call, CallReader, Function, ToolUse, split, tool_syntax
from tests import tiny_server

WEATHER = Function(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "Current weather",
)
TIME = Function(
    "get_time",
    {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
)
PARIS = {"city": "Paris"}

# Tool calls as Llama 3.1 and Mistral v0.3 templates write them (the rest of those templates left
# out).
LLAMA3_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.tool_calls %}{% set tool_call = m.tool_calls[0].function %}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}"
    "{{- tool_call.arguments | tojson }}"
    "{{- '}' }}{% else %}{{ m.content }}{% endif %}{% endfor %}<|assistant|>"
)
MISTRAL_TEMPLATE = (
    "{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS] [{% for tool_call in m.tool_calls %}"
    "{% set out = tool_call.function | tojson %}{{ out[:-1] }}"
    "{{ ', \"id\": \"' + tool_call.id + '\"}' }}"
    "{% endfor %}]{% else %}[INST] {{ m.content }}[/INST]{% endif %}{% endfor %}"
)


def tokenizer(family: str):
    """The tiny byte tokenizer with a template of ``family``, wrapped as mlx-lm's load would."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from mlx_lm.tool_parsers import mistral

    from tests.helpers import tiny_byte_tokenizer

    if family == "hermes":
        return tiny_server.tokenizer(hermes=True)
    byte_tokenizer = tiny_byte_tokenizer()
    if family == "llama3":  # mlx-lm has no parser for it: recognised by tools.py
        byte_tokenizer.chat_template = LLAMA3_TEMPLATE
        return TokenizerWrapper(byte_tokenizer)
    # one token, as in Mistral's
    byte_tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    byte_tokenizer.chat_template = MISTRAL_TEMPLATE
    return TokenizerWrapper(
        byte_tokenizer,
        tool_parser=mistral.parse_tool_call,
        tool_call_start=mistral.tool_call_start,
        tool_call_end=mistral.tool_call_end,
    )


def written_call(tok, arguments: dict, call_id: str = "abc123XYZ") -> str:
    """What the template writes for the assistant's call of get_weather(arguments)."""
    user = [{"role": "user", "content": "Weather in Paris?"}]
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    whole = tok.apply_chat_template(
        user + [{"role": "assistant", "content": "", "tool_calls": [call]}], tokenize=False
    )
    common = next(i for i, (a, b) in enumerate(zip(prompt + "\0", whole)) if a != b)
    # up to the next turn
    return whole[common:].split("<|assistant|>")[0].split("\nassistant:")[0].strip()


def accepts(tok, grammar: str, text: str) -> bool:
    """Whether llguidance takes ``text`` (as the tokenizer writes it) whole under ``grammar``."""
    import llguidance

    from constrained.grammar import compile_grammar, ll_tokenizer_of

    matcher = llguidance.LLMatcher(ll_tokenizer_of(tok), compile_grammar(grammar), log_level=0)
    return (
        matcher.consume_tokens(tok.encode(text, add_special_tokens=False))
        and matcher.is_accepting()
    )


@pytest.mark.parametrize(
    "family, syntax", [("hermes", "json_tools"), ("llama3", "llama3_json"), ("mistral", "mistral")]
)
def test_each_family_writes_calls_its_grammar_accepts_and_its_parser_reads_back(family, syntax):
    tok = tokenizer(family)
    found = tool_syntax(tok)
    assert found.name == syntax
    written = written_call(tok, PARIS)
    bad = written_call(tok, {"city": 42})  # against the schema
    for choice in ("auto", "required", "get_weather"):
        tools = ToolUse([WEATHER, TIME], choice, syntax=found)
        assert accepts(tok, tools.grammar(), written), (choice, written)
        assert not accepts(tok, tools.grammar(), bad), (choice, bad)
        text, calls = split(tools.reader(), written)
        assert text == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", PARIS)
        ]
    auto = ToolUse([WEATHER], "auto", syntax=found)
    assert accepts(tok, auto.grammar(), "No call needed.")  # free text, no call
    assert split(auto.reader(), "No call needed.") == ("No call needed.", [])
    forced = ToolUse([WEATHER], "required", syntax=found)
    assert not accepts(tok, forced.grammar(), "No call needed.")


def test_a_special_token_marker_is_written_as_that_token():
    tok = tokenizer("mistral")
    found = tool_syntax(tok)
    ((marker, token),) = found.special
    assert marker == "[TOOL_CALLS]" and tok.encode(marker, add_special_tokens=False) == [token]
    assert f"<[{token}]>" in ToolUse([WEATHER], "auto", syntax=found).grammar()


def test_once_a_call_opens_the_grammar_forces_its_json_up_to_the_arguments():
    import llguidance

    from constrained.grammar import compile_grammar, ll_tokenizer_of

    tok = tokenizer("hermes")
    matcher = llguidance.LLMatcher(
        ll_tokenizer_of(tok),
        compile_grammar(ToolUse([WEATHER], "auto", syntax=tool_syntax(tok)).grammar()),
        log_level=0,
    )
    assert matcher.consume_tokens(tok.encode("Let me look.\n<tool_call>"))
    # What the forced-text source drafts for free: the one tool's name and its first key.
    assert matcher.compute_ff_bytes() == b'\n{"name": "get_weather", "arguments": {"city": "'


CALLS_TEXT = (
    "Let me check both.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>\nDone: 3 < 4.'
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=200))
def test_the_reader_never_shows_markup_however_the_text_is_cut(cuts):
    tok = tokenizer("hermes")
    reader = ToolUse([WEATHER, TIME], "auto", syntax=tool_syntax(tok)).reader()
    items, start = [], 0
    for cut in cuts + [len(CALLS_TEXT)]:
        items += reader.add(CALLS_TEXT[start : start + cut])
        start += cut
    items += reader.finish()
    texts = [item for item in items if isinstance(item, str)]
    assert (
        texts
        and not any("<" in t and "tool" in t for t in texts)
        and not any("/tool" in t for t in texts)
    )
    assert "".join(texts) == "Let me check both.Done: 3 < 4."
    assert [item for item in items if isinstance(item, Call)] == [
        Call("get_weather", '{"city": "Paris"}'),
        Call("get_time", '{"zone": "CET"}'),
    ]


def test_a_call_cut_short_is_dropped_and_a_lone_marker_prefix_is_text():
    syntax = tool_syntax(tokenizer("hermes"))
    assert split(CallReader(syntax, []), 'Hi <tool_call>\n{"name": "get_weather", "argum') == (
        "Hi",
        [],
    )
    assert split(CallReader(syntax, []), "a <tool") == ("a <tool", [])


def test_without_a_template_syntax_a_forced_call_is_bare_json_and_auto_is_text():
    required = ToolUse([WEATHER, TIME], "required", syntax=None)
    assert required.grammar() is None and [
        o["properties"]["name"] for o in required.json_schema()["anyOf"]
    ] == [{"const": "get_weather"}, {"const": "get_time"}]
    assert split(required.reader(), '{"name":"get_time","arguments":{"zone":"UTC"}}') == (
        "",
        [Call("get_time", '{"zone": "UTC"}')],
    )
    named = ToolUse([WEATHER, TIME], "get_weather", syntax=None)
    assert named.json_schema() == WEATHER.parameters
    assert split(named.reader(), '{"city":"Oslo"}') == (
        "",
        [Call("get_weather", '{"city":"Oslo"}')],
    )
    assert split(named.reader(), '{"city":"Os') == ('{"city":"Os', [])  # cut short: shown as it is
    assert split(ToolUse([WEATHER], "auto").reader(), "<tool_call>") == ("<tool_call>", [])


def test_a_syntax_without_a_grammar_is_parsed_but_not_constrained():
    """mlx-lm's pythonic parser (LFM2): calls are read out; a forced call falls back to bare
    JSON."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from mlx_lm.tool_parsers import pythonic

    from tests.helpers import tiny_byte_tokenizer

    tok = TokenizerWrapper(
        tiny_byte_tokenizer(),
        tool_parser=pythonic.parse_tool_call,
        tool_call_start=pythonic.tool_call_start,
        tool_call_end=pythonic.tool_call_end,
    )
    auto = ToolUse([WEATHER], "auto", syntax=tool_syntax(tok))
    assert auto.grammar() is None
    assert split(
        auto.reader(), 'Sure.<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>'
    ) == ("Sure.", [Call("get_weather", '{"city": "Paris"}')])
    forced = ToolUse([WEATHER], "required", syntax=tool_syntax(tok))
    assert forced.syntax is None and forced.json_schema() is not None
