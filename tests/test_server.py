"""The OpenAI-compatible server (server/), driven by the official ``openai`` client.

Fast tests check request parsing and stop strings without a model. The slow ones start one server
(``python -m server --port 0``) with the embedded model and talk to it over HTTP.
"""

import asyncio
import importlib.util
import json
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from constrained import schema_to_regex
from server.job import StopText
from server.protocol import parse_chat, parse_completion
from server.request import ApiError, parse_body
from tests.helpers import start_process, stop

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France? Answer in one sentence."
USER_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    # closed, as OpenAI's strict mode asks
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


# ---- without a model
# -------------------------------------------------------------------------------


class FakeTokenizer:
    chat_template = "one token per message: its length"

    def apply_chat_template(self, messages, add_generation_prompt=True, **options):
        return [len(m["content"]) for m in messages]

    def encode(self, text):
        return [ord(c) for c in text]


def chat(**body):
    return parse_chat(
        {"messages": [{"role": "user", "content": "hi"}], **body}, FakeTokenizer(), MODEL, 64
    )


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"temperature": "hot"}, "'temperature' must be a number"),
        ({"temperature": 3}, "'temperature' must be between"),
        ({"temperature": 10**400}, "'temperature' must be between"),
        ({"top_p": float("nan")}, "'top_p' must be between"),
        ({"guided_regex": "a", "guided_grammar": "start: 'a'"}, "not both"),
        ({"max_tokens": True}, "'max_tokens' must be an integer"),
        ({"max_tokens": 0}, "at least 1"),
        ({"n": 0}, "'n' must be an integer between 1 and 8"),
        ({"n": 9}, "'n' must be an integer between 1 and 8"),
        ({"n": 1.5}, "'n' must be an integer"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "up to 4"),
        ({"temperatur": 0}, "unrecognized request argument: temperatur"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"tool_choice": "required"}, "'tool_choice' needs 'tools'"),
        (
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "tool_choice",
        ),
        ({"logprobs": True, "top_logprobs": 30}, "'top_logprobs' must be between 0 and 20"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {}, "stric": True},
                }
            },
            "unrecognized argument response_format.json_schema.stric",
        ),
    ],
)
def test_bad_chat_requests_are_400_with_the_field_named(body, fragment):
    with pytest.raises(ApiError) as caught:
        chat(**body)
    assert caught.value.status == 400 and fragment in caught.value.message
    assert caught.value.body()["error"]["type"] == "invalid_request_error"


def test_unknown_model_is_404_and_malformed_json_400():
    with pytest.raises(ApiError) as caught:
        chat(model="gpt-4")
    assert caught.value.status == 404 and caught.value.code == "model_not_found"
    for raw in (b"{bad", b"[1]", b"\xff", b"[" * 100_000):
        with pytest.raises(ApiError) as caught:
            parse_body(raw)
        assert caught.value.status == 400


def test_requests_become_generation_options():
    request = chat(
        temperature=0,
        max_completion_tokens=7,
        stop="\n",
        seed=3,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "u", "schema": USER_SCHEMA},
        },
    )
    assert request.sampling.temp == 0.0
    assert (request.max_tokens, request.stop, request.seed) == (7, ["\n"], 3)
    # compiled by the engine
    assert json.loads(request.schema) == USER_SCHEMA and request.regex is None
    forced = chat(tools=[WEATHER_TOOL], tool_choice="required")
    # no template syntax: bare JSON
    assert forced.tools.choice == "required" and forced.tools.syntax is None
    regex = schema_to_regex(json.loads(forced.schema))
    assert re.fullmatch(
        regex, '{"name":"get_weather","arguments":{"city":"Oslo","unit":"celsius"}}'
    )
    completion = parse_completion({"prompt": "ab", "max_tokens": 3}, FakeTokenizer(), MODEL, 64)
    assert completion.prompt == [97, 98] and completion.max_tokens == 3


def test_every_kind_of_request_reaches_the_other_ranks_whole():
    """A sharded server pickles each joining request for the other ranks (server/ranks.py)."""
    import pickle

    from constrained.think_markers import START, ThinkMarkers
    from constrained.thinking import Thinking
    from server.engine import Engine
    from server.job import Job

    requests = [
        chat(tools=[WEATHER_TOOL], tool_choice="required", stop=["\n"], seed=3, logprobs=True),
        chat(response_format={"type": "json_schema",
                              "json_schema": {"name": "u", "schema": USER_SCHEMA}}),
        chat(guided_regex="[a-z]+", temperature=0.7, top_p=0.9),
    ]  # fmt: skip
    requests[0].thinking = Thinking(ThinkMarkers("<think>", "</think>", (1,), (2,)), START, 8)
    joins = [Job(request, None) for request in requests]
    sent, leaves, stop = Engine._message(joins, [4], False)
    received = pickle.loads(pickle.dumps((sent, leaves, stop)))
    assert received == (sent, [4], False)
    assert all(r.messages is None for r in received[0])  # only rank 0 reads them
    assert [replace(r, messages=None) for r in requests] == received[0]


def test_draft_source_flags_mean_the_same_in_main_py_and_the_server(embedded, monkeypatch):
    """`--draft-head REPO_ID` is downloaded, and every draft-source flag builds the same sources,
    in `python main.py` and `python -m server` alike."""
    import huggingface_hub

    import loading.load as loading
    import main
    from draft_head.head import SHIPPED_HEAD
    from server import __main__ as server_main

    downloads = []

    def download(repo_id, **options):
        downloads.append(repo_id)
        return str(SHIPPED_HEAD)  # as if fetched from the Hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    monkeypatch.setattr(loading, "load_model", lambda *args, **kwargs: embedded)
    flags = [
        "--draft-head",
        "someone/smollm2-head",
        "--prompt-lookup",
        "--num-draft",
        "3",
        "--ngram-max",
        "2",
    ]
    main_args = main.build_parser().parse_args(flags + ["--prompt", "hi"])
    main.validate(main_args)
    _, _, _, kwargs = main.build_run(main_args)
    server_args = server_main.build_parser().parse_args(flags)
    server_main.validate(server_args)
    engine, _, _ = server_main.build_engine(server_args)
    assert downloads == ["someone/smollm2-head"] * 2
    for drafts in (kwargs["draft_sources"], engine.make_sources()):
        assert [source.name for source in drafts] == ["prompt_lookup", "draft_head"]
        assert [source.num_draft for source in drafts] == [3, 3] and drafts[0].ngram_max == 2


def test_main_py_and_the_server_template_a_system_message_alike(embedded, monkeypatch):
    import loading.load as loading
    import main

    _, tokenizer, _ = embedded
    messages = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": QUESTION},
    ]
    # the oracle, written out
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    monkeypatch.setattr(loading, "load_model", lambda *args, **kwargs: embedded)
    args = main.build_parser().parse_args(
        ["--system", messages[0]["content"], "--prompt", QUESTION]
    )
    main.validate(args)
    _, _, prompt, _ = main.build_run(args)
    request = parse_chat({"messages": messages}, tokenizer, MODEL, 64)
    assert prompt == request.prompt == expected
    args = main.build_parser().parse_args(["--prompt", QUESTION])
    main.validate(args)
    _, _, plain, _ = main.build_run(args)
    assert plain != expected  # the system message made a difference


@pytest.mark.parametrize(
    "pieces, stop, expected_sent, stopped",
    [
        (["Hel", "lo\nWor", "ld"], ["\n"], ["Hel", "lo"], True),
        # held back while it may start a stop string
        (["a<", "/", "b>c"], ["</b>"], ["a", "", ""], True),
        (["a<", "x"], ["</b>"], ["a", "<x"], False),
        (["abc"], [], ["abc"], False),
    ],
)
def test_stop_text_holds_back_possible_stop_prefixes(pieces, stop, expected_sent, stopped):
    stopper, sent, found = StopText(stop), [], False
    for piece in pieces:
        text, found = stopper.add(piece)
        sent.append(text)
        if found:
            break
    assert sent == expected_sent and found == stopped


# ---- the engine with a tiny random model: how JSON schemas compile
# ------------------------------------

# regex: "multipleOf 7"
ONLY_LLGUIDANCE = {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 99}
# llguidance: "Unimplemented keys"; regex: "not"
NEITHER = {"type": "string", "not": {"const": "a"}}
FALLBACK_NOTE = (
    "note: llguidance refused the schema (Expecting object schema to apply options); "
    "using the built-in compiler\n"
)


@pytest.fixture(scope="module")
def tiny_engine():
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from server.engine import Engine
    from tests.helpers import tiny_byte_tokenizer, tiny_llama

    tokenizer = tiny_byte_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    vocab_size = len(tokenizer) + 5
    return Engine(
        tiny_llama(vocab_size=vocab_size, seed=7, sharp=3.0),
        TokenizerWrapper(tokenizer),
        vocab_size,
    )


def chat_request(engine, schema=None, max_tokens=8):
    """A greedy chat request, with ``schema`` as its response_format when one is given."""
    body = {
        "messages": [{"role": "user", "content": "a number"}],
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    if schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": schema},
        }
    return parse_chat(body, engine.tokenizer, MODEL, 64)


async def outcome_of(job):
    """The job's Outcome once it is done; an error event is raised."""
    while True:
        kind, payload = await asyncio.wait_for(job.events.get(), 60)
        if kind == "error":
            raise payload
        if kind == "done":
            return payload


def schema_outcome(engine, schema, max_tokens=8):
    """A chat request with ``schema`` as its response_format, through the engine's queue: its
    Outcome."""
    request = chat_request(engine, schema, max_tokens)

    async def run():
        return await outcome_of(engine.submit(request, asyncio.get_running_loop()))

    return asyncio.run(run())


def test_the_server_compiles_json_schemas_with_llguidance(tiny_engine):
    import jsonschema

    outcome = schema_outcome(tiny_engine, ONLY_LLGUIDANCE)
    assert outcome.finish_reason == "stop"
    jsonschema.validate(json.loads(outcome.text), ONLY_LLGUIDANCE)
    assert tiny_engine.constraints.built[("schema", json.dumps(ONLY_LLGUIDANCE))][0] == "grammar"


def test_the_server_falls_back_to_the_built_in_compiler_once_per_schema(tiny_engine, capsys):
    for _ in range(2):
        schema_outcome(tiny_engine, True, max_tokens=3)
    # in the log, once: the compiled schema is cached
    assert capsys.readouterr().err == FALLBACK_NOTE
    assert tiny_engine.constraints.built[("schema", "true")][0] == "regex"


def test_a_schema_both_compilers_refuse_is_a_400(tiny_engine):
    with pytest.raises(ApiError) as caught:
        schema_outcome(tiny_engine, NEITHER)
    assert caught.value.status == 400 and caught.value.param == "response_format"
    assert caught.value.message == (
        "the JSON schema is not supported: llguidance refused the schema: Unimplemented "
        'keys: ["not"]; the built-in compiler refused it too: not is not supported at #'
    )


def test_a_new_schema_is_compiled_off_the_worker_while_other_rows_decode(tiny_engine, monkeypatch):
    release, building = threading.Event(), threading.Event()
    build = tiny_engine.constraints.build

    def slow_build(kind, pattern):  # stands for a large schema's second or more of compiling
        building.set()
        assert release.wait(60), "the test never released the build"
        return build(kind, pattern)

    monkeypatch.setattr(tiny_engine.constraints, "build", slow_build)
    schema = {"type": "integer", "maximum": 12345}  # in no other test: not cached yet

    async def run():
        loop = asyncio.get_running_loop()
        pending = loop.run_in_executor(
            None, tiny_engine.constraint_for, chat_request(tiny_engine, schema)
        )
        await loop.run_in_executor(None, building.wait, 60)
        # nothing to build
        await outcome_of(tiny_engine.submit(chat_request(tiny_engine, max_tokens=4), loop))
        assert not pending.done()  # the plain request finished while the schema was still compiling
        release.set()
        prepared = await pending
        outcome = await outcome_of(
            tiny_engine.submit(chat_request(tiny_engine, schema), loop, prepared)
        )
        assert outcome.finish_reason == "stop" and int(outcome.text) <= 12345

    try:
        asyncio.run(run())
    finally:
        release.set()


def test_requests_that_need_the_same_new_schema_build_it_once(tiny_engine, monkeypatch):
    calls, first_in = [], threading.Event()
    build = tiny_engine.constraints.build

    def counted_build(kind, pattern):
        calls.append(pattern)
        first_in.set()
        time.sleep(0.3)  # the other requests arrive while it builds
        return build(kind, pattern)

    monkeypatch.setattr(tiny_engine.constraints, "build", counted_build)
    request = chat_request(tiny_engine, {"type": "integer", "minimum": 7})
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(tiny_engine.constraint_for, request)
        first_in.wait(30)
        others = [pool.submit(tiny_engine.constraint_for, request) for _ in range(3)]
        built = [future.result(timeout=60) for future in [first] + others]
    assert len(calls) == 1
    # each request its own, from one build
    assert len({id(constraint) for constraint, _ in built}) == 4


def test_a_request_is_refused_only_when_every_row_and_queue_place_is_taken():
    """Two rows and one queue place: three requests submitted back to back are all taken, however
    soon the worker picks the first up, and a fourth is a 503 until a cancelled one leaves."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from server.engine import Engine
    from tests.helpers import tiny_byte_tokenizer, tiny_llama

    tokenizer = tiny_byte_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    engine = Engine(
        tiny_llama(vocab_size=len(tokenizer), seed=7),
        TokenizerWrapper(tokenizer),
        len(tokenizer),
        max_batch=2,
        max_queue=1,
    )
    body = {
        "messages": [{"role": "user", "content": "a"}],
        "max_tokens": 9000,
        "guided_regex": "a{8000}",
    }
    request = parse_chat(body, engine.tokenizer, MODEL, 64)  # cannot end before 8000 tokens

    async def run():
        loop = asyncio.get_running_loop()
        jobs = [engine.submit(request, loop) for _ in range(3)]
        try:
            with pytest.raises(ApiError) as caught:
                engine.submit(request, loop)
            assert caught.value.status == 503
            jobs[0].cancelled.set()  # the worker drops its row at its next step
            for _ in range(200):
                await asyncio.sleep(0.05)
                try:
                    jobs.append(engine.submit(request, loop))
                    return
                except ApiError:
                    pass
            pytest.fail("the cancelled request never gave its place back")
        finally:
            for job in jobs:
                job.cancelled.set()
            for _ in range(200):  # the worker drops the rows while their event loop still runs
                if not engine.replies and not len(engine.generator):
                    break
                await asyncio.sleep(0.05)

    asyncio.run(run())


# ---- one server for the slow tests
# ------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    process = start_process(
        [
            sys.executable,
            "-m",
            "server",
            "--port",
            "0",
            "--api-key",
            API_KEY,
            "--max-queue",
            "4",
            "--max-tokens",
            "32",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # "serving MODEL on http://127.0.0.1:PORT/v1", or EOF on failure
    line = process.stdout.readline()
    if not line.startswith("serving"):
        stop(process)
        pytest.fail(f"the server did not start: {line}{process.stderr.read()[-2000:]}")
    url = line.split()[-1]
    yield process, url
    stop(process)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[1], api_key=API_KEY, max_retries=0, timeout=120)


def main_py_text(*args):
    output = subprocess.run(
        [sys.executable, "main.py", "--json", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    return json.loads(output)["text"]


@pytest.mark.slow
def test_greedy_chat_equals_main_py(client):
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=24,
        logprobs=True,
        top_logprobs=2,
    )
    assert answer.choices[0].message.content == main_py_text(
        "--prompt", QUESTION, "--max-tokens", "24"
    )
    assert answer.usage.completion_tokens <= 24 and answer.usage.prompt_tokens > 20
    # the real tokenizer's token strings spell the answer
    content = answer.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == answer.choices[0].message.content
    assert all(entry.top_logprobs[0].token == entry.token for entry in content)  # greedy


@pytest.mark.slow
def test_a_longer_prompt_reuses_the_cache_and_decodes_the_same(client):
    first = "The quick brown fox jumps over the lazy dog. " * 4
    client.completions.create(model=MODEL, prompt=first, max_tokens=2, temperature=0)
    second = first + "The quick brown"
    answer = client.completions.create(model=MODEL, prompt=second, max_tokens=12, temperature=0)
    assert answer.usage.prompt_tokens_details.cached_tokens >= 40  # of 44 + 3 prompt tokens
    assert answer.choices[0].text == main_py_text(
        "--no-chat-template", "--prompt", second, "--max-tokens", "12"
    )


@pytest.mark.slow
def test_streaming_sends_the_same_text_and_usage_last(client):
    messages = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=16
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )
    decoding = chunks[-1].usage.model_extra["decoding"]
    assert (
        decoding["target_forward_passes"] >= 1
        and decoding["draft_proposed"] >= decoding["draft_accepted"]
    )


@pytest.mark.slow
def test_a_seed_makes_sampling_repeatable(client):
    texts = [
        client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=seed
        )
        .choices[0]
        .text
        for seed in (7, 7, 8)
    ]
    assert texts[0] == texts[1] != texts[2]


@pytest.mark.slow
def test_json_schema_output_validates(client):
    import jsonschema

    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a user as JSON."}],
        max_tokens=40,
        seed=1,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "user", "schema": USER_SCHEMA, "strict": True},
        },
    )
    jsonschema.validate(json.loads(answer.choices[0].message.content), USER_SCHEMA)
    # the forced '{"name":"' and '","age":'
    assert answer.usage.model_extra["decoding"]["draft_accepted"] > 0


@pytest.mark.slow
def test_json_schemas_llguidance_serves_or_the_built_in_compiler_or_neither(client):
    import jsonschema
    import openai

    messages = [{"role": "user", "content": "Three prime numbers as a JSON array."}]
    for schema in (True, ONLY_LLGUIDANCE):  # the built-in compiler (a note in the log), llguidance
        answer = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=40,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema},
            },
        )
        assert answer.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": NEITHER},
            },
        )
    assert "the built-in compiler refused it too" in caught.value.body["message"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_call_arguments_validate(client, tool_choice):
    import jsonschema

    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        temperature=0,
        max_tokens=60,
        tools=[WEATHER_TOOL],
        tool_choice=tool_choice,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])


@pytest.mark.slow
def test_guided_regex_and_stop(client):
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A date?"}],
        temperature=0,
        extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}"},
    )
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", answer.choices[0].message.content)
    answer = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=20, stop=[" 7"]
    )
    assert answer.choices[0].finish_reason == "stop" and " 7" not in answer.choices[0].text


@pytest.mark.slow
def test_guided_grammar_output_is_in_the_language_and_a_bad_one_is_400(client):
    import openai

    grammar = 'start: "The capital of France is " CITY "."\nCITY: /[A-Z][a-z]+/'
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Capital of France?"}],
        temperature=0,
        max_tokens=16,
        extra_body={"guided_grammar": grammar},
    )
    assert re.fullmatch(
        r"The capital of France is [A-Z][a-z]+\.", answer.choices[0].message.content
    )
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"guided_grammar": "start: undefined_rule"},
        )
    assert caught.value.body["type"] == "invalid_request_error"


@pytest.mark.slow
@pytest.mark.parametrize("page", ["README.md", "docs/batching.md"])
def test_the_docs_server_examples_print_what_they_say(server, page):
    code = re.search(r"^```py\n(.*?)^```", (ROOT / page).read_text(), flags=re.S | re.M).group(1)
    expected = re.search(r"# ([{\[].*[}\]])$", code, flags=re.M).group(1)
    code = code.replace("http://127.0.0.1:8080/v1", server[1]).replace(
        'api_key="none"', f'api_key="{API_KEY}"'
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.stdout.strip() == expected, result.stdout + result.stderr[-2000:]


@pytest.mark.slow
def test_errors_are_openai_shaped_and_the_server_keeps_serving(server, client):
    import openai

    messages = [{"role": "user", "content": "hi"}]
    cases = [
        (openai.NotFoundError, "model_not_found", dict(model="gpt-4", messages=messages)),
        (
            openai.BadRequestError,
            "context_length_exceeded",
            dict(model=MODEL, messages=[{"role": "user", "content": "word " * 9000}]),
        ),
        (
            openai.BadRequestError,
            None,
            dict(model=MODEL, messages=messages, extra_body={"guided_regex": "(a"}),
        ),
        (openai.BadRequestError, None, dict(model=MODEL, messages=messages, n=9)),
    ]
    if importlib.util.find_spec("constrained.grammar") is None:  # else another test's business
        cases.append(
            (
                openai.BadRequestError,
                None,
                dict(model=MODEL, messages=messages, extra_body={"guided_grammar": "start: 'a'"}),
            )
        )
    for error, code, request in cases:
        with pytest.raises(error) as caught:
            client.chat.completions.create(**request)
        assert caught.value.body["message"] and caught.value.body["type"] == "invalid_request_error"
        assert caught.value.body["code"] == code
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server[1], api_key="wrong", max_retries=0).models.list()
    raw = post(server[1], "/chat/completions", b"{not json")
    assert raw.status == 400 and json.loads(raw.read())["error"]["type"] == "invalid_request_error"
    raw = post(server[1], "/completions", b" " * (17 * 2**20))
    assert raw.status == 413 and "larger than 16 MiB" in json.loads(raw.read())["error"]["message"]
    assert [m.id for m in client.models.list().data] == [MODEL]  # still serving


def post(base_url: str, path: str, body: bytes, read: bool = True):
    """A raw POST (stdlib http.client), to send bad JSON or hang up mid-stream; the response,
    or the connection when not ``read``."""
    from http.client import HTTPConnection
    from urllib.parse import urlsplit

    url = urlsplit(base_url)
    connection = HTTPConnection(url.hostname, url.port, timeout=60)
    connection.request(
        "POST",
        url.path + path,
        body,
        {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    return connection.getresponse() if read else connection


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1))


@pytest.mark.slow
def test_disconnect_mid_stream_stops_the_generation(server, client):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 4000,
        "temperature": 0,
        "stream": True,
    }
    response = post(server[1], "/chat/completions", json.dumps(body).encode())
    received = [response.readline() for _ in range(6)]
    response.close()  # and the connection with it
    assert response.status == 200 and sum(line.startswith(b"data:") for line in received) == 3
    assert_next_request_is_not_held_up(client)
    # The same without streaming: the handler notices the closed connection while it waits.
    body["stream"] = False
    connection = post(server[1], "/chat/completions", json.dumps(body).encode(), read=False)
    time.sleep(2)
    connection.close()
    assert_next_request_is_not_held_up(client)


def assert_next_request_is_not_held_up(client):
    # 4000 tokens take minutes; the next request is answered as soon as the cancelled one stops.
    start = time.perf_counter()
    answer = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert answer.usage.completion_tokens == 2 and time.perf_counter() - start < 30


@pytest.mark.slow
def test_load_16_clients_64_requests_none_lost(server, client):
    """Every request is answered or refused with 503 (queue of 4), and memory stays bounded."""
    import openai

    rss_before = rss_kib(server[0].pid)
    outcomes, lock = [], threading.Lock()

    def one(index):
        try:
            answer = client.completions.create(
                model=MODEL, prompt=f"Count: {index},", max_tokens=3, temperature=0
            )
            result = ("ok", answer.usage.completion_tokens)
        except openai.APIStatusError as error:
            result = (error.status_code, error.response.headers.get("retry-after"))
        with lock:
            outcomes.append(result)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(one, range(64)))
    assert time.perf_counter() - start < 240
    assert len(outcomes) == 64
    answered = [o for o in outcomes if o[0] == "ok"]
    refused = [o for o in outcomes if o[0] != "ok"]
    assert all(o == (503, "1") for o in refused) and all(1 <= o[1] <= 3 for o in answered)
    assert len(answered) >= 5  # the running request and a full queue, at least
    assert rss_kib(server[0].pid) - rss_before < 300_000
    assert client.models.list().data  # still serving


@pytest.mark.slow
def test_requests_decoded_together_each_get_the_text_they_get_alone(client):
    """Continuous batching: four requests of different lengths, one with a schema, sent at once
    (they join one batch as they arrive) give exactly what each gives alone."""
    requests = [
        dict(messages=[{"role": "user", "content": QUESTION}], max_tokens=24),
        dict(messages=[{"role": "user", "content": "Name three colours."}], max_tokens=9),
        dict(
            messages=[{"role": "user", "content": "Anna, 34. Give her as JSON."}],
            max_tokens=30,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "u", "schema": USER_SCHEMA},
            },
        ),
        dict(
            messages=[{"role": "user", "content": "Repeat: red, green, blue, red, green, blue."}],
            max_tokens=16,
        ),
    ]

    def ask(request):
        answer = client.chat.completions.create(model=MODEL, temperature=0, **request)
        return answer.choices[0].message.content, answer.usage.completion_tokens

    alone = [ask(request) for request in requests]
    with ThreadPoolExecutor(max_workers=4) as pool:
        together = list(pool.map(ask, requests))
    assert together == alone
    assert [tokens for _, tokens in alone] != [alone[0][1]] * 4  # rows of different lengths
    json.loads(alone[2][0])


@pytest.mark.slow
def test_interleaved_conversations_each_reuse_their_own_cached_prefix(client):
    """The prompt cache keeps several conversations: turns of two conversations in turn each
    prefill only their new message."""
    document = (ROOT / "demo" / "museum.txt").read_text()
    conversations = [
        [
            {"role": "system", "content": f"Conversation {c}: answer briefly."},
            {"role": "user", "content": document},
        ]
        for c in range(2)
    ]
    cached = {}
    for turn, question in enumerate(["When did the museum open?", "Who founded it?"]):
        for c, messages in enumerate(conversations):
            if turn:
                messages.append({"role": "user", "content": question})
            answer = client.chat.completions.create(
                model=MODEL, messages=messages, temperature=0, max_tokens=8
            )
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
            cached[turn, c] = (
                answer.usage.prompt_tokens,
                answer.usage.prompt_tokens_details.cached_tokens,
            )
    for c in range(2):
        first_prompt, _ = cached[0, c]
        prompt, hit = cached[1, c]
        # only the last answer and the new question
        assert hit >= first_prompt and prompt - hit < 40


@pytest.mark.slow
def test_draft_sources_keep_the_greedy_output(client):
    """A second server with prompt lookup and the draft head: the same text and logprobs, fewer
    target passes."""
    from openai import OpenAI

    process = start_process(
        [sys.executable, "-m", "server", "--port", "0", "--prompt-lookup", "--draft-head"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("serving"), process.stderr.read()[-2000:]
        drafted = OpenAI(base_url=line.split()[-1], api_key="none", max_retries=0, timeout=120)
        prompt = (ROOT / "demo" / "museum.txt").read_text()
        answers = [
            c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": prompt}],
                temperature=0,
                max_tokens=32,
            )
            for c in (client, drafted)
        ]
        # Rows drafting with the head report logprobs as any row does (read from the verify pass).
        logprobs = [
            c.completions.create(
                model=MODEL, prompt="Hi there", max_tokens=4, logprobs=2, temperature=0
            )
            .choices[0]
            .logprobs
            for c in (client, drafted)
        ]
    finally:
        stop(process)
    assert answers[1].choices[0].message.content == answers[0].choices[0].message.content
    assert logprobs[1].tokens == logprobs[0].tokens
    assert logprobs[1].token_logprobs == pytest.approx(logprobs[0].token_logprobs, abs=1e-3)
    plain, fast = (a.usage.model_extra["decoding"] for a in answers)
    assert (
        fast["draft_accepted"] > 0
        and fast["target_forward_passes"] < plain["target_forward_passes"]
    )


@pytest.mark.slow
def test_a_taken_port_or_bad_flag_is_one_line_before_the_model_loads():
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        for argv, message in (
            (["--port", port], "cannot listen on 127.0.0.1:"),
            (["--max-queue", "-1"], "--max-queue"),
            (["--kv-bits", "8", "--quantized-kv-start", "64"], "quantizes from the first token"),
        ):
            result = subprocess.run(
                [sys.executable, "-m", "server", *argv],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert (
                result.returncode == 1
                and result.stderr.startswith("error: ")
                and message in result.stderr
            )
            assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_the_server_docs_examples_run(server):
    """docs/server.md's Python examples: chat completions with response_format (it prints what its
    comment says), Responses with text.format, a Messages tool round trip."""
    docs = (ROOT / "docs" / "server.md").read_text()
    blocks = re.findall(r"^```py\n(.*?)^```", docs, flags=re.S | re.M)
    outputs = []
    for code in blocks:
        code = (
            code.replace("http://127.0.0.1:8080/v1", server[1])
            .replace("http://127.0.0.1:8080", server[1].removesuffix("/v1"))
            .replace('api_key="none"', f'api_key="{API_KEY}"')
        )
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr[-2000:]
        outputs.append(result.stdout.strip())
    assert len(outputs) == 3
    assert outputs[0] == re.search(r"# ([{\[].*[}\]])$", blocks[0], flags=re.M).group(1)
    person, cached = outputs[1].rsplit(" ", 1)
    assert set(json.loads(person)) == {"name", "age"} and int(cached) >= 0
    # the tool result's turn read the first turn from the cache
    assert int(outputs[2].rsplit(" ", 1)[1]) > 0
