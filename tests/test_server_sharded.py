"""The server on a target sharded over local ranks (mlx.launch, ring backend) answers what one
process answers, under concurrent requests of every kind, and fails cleanly.

One launch serves most tests (the embedded model loads on every rank; this machine has 2 cores),
and the test that kills one of its ranks comes last.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection
from pathlib import Path
from urllib.parse import urlsplit

import mlx.core as mx
import pytest

from loading import fast_blas
from tests.helpers import start_process, stop
from tests.test_distributed import LAUNCH, free_port
from tests.test_server import USER_SCHEMA, WEATHER_TOOL

ROOT = Path(__file__).resolve().parent.parent
MODEL = "SmolLM2-135M-Instruct"
SOURCES = ["--prompt-lookup", "--draft-head"]
DIST_TIMEOUT = 12

pytestmark = [
    pytest.mark.slow,  # launches ranks
    pytest.mark.skipif(LAUNCH is None, reason="mlx.launch is not installed"),
    pytest.mark.skipif(
        not mx.distributed.is_available(backend="ring"), reason="MLX has no ring backend"
    ),
]


def chat(content: str, max_tokens: int = 24, **extra) -> tuple:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    return "/chat/completions", {**body, "max_tokens": max_tokens, "temperature": 0, **extra}


MUSEUM = (ROOT / "demo" / "museum.txt").read_text()
# Requests of every kind; each is answered greedily, so the batch it lands in cannot change it.
REQUESTS = [
    chat("Name three colours."),
    chat(MUSEUM + "\nWhen does the museum open on Sundays?", 32),  # grounded: lookup drafts
    chat(
        "Describe a user.",
        48,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "user", "schema": USER_SCHEMA},
        },
    ),  # fmt: skip
    chat("A date?", 16, guided_regex=r"\d{4}-\d{2}-\d{2}"),
    chat("Capital of France?", 16, guided_grammar='start: "It is " CITY "."\nCITY: /[A-Z][a-z]+/'),
    chat("Weather in Paris?", 48, tools=[WEATHER_TOOL], tool_choice="required"),
    chat("Count to ten.", 20, stream=True),
    (
        "/completions",
        {
            "model": MODEL,
            "prompt": "The capital of France is",
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": 2,
        },
    ),  # fmt: skip
    (
        "/messages",
        {
            "model": MODEL,
            "max_tokens": 20,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello in French."}],
        },
    ),  # fmt: skip
    (
        "/responses",
        {"model": MODEL, "input": "List three fruits.", "max_output_tokens": 20, "temperature": 0},
    ),  # fmt: skip
]
SAMPLED = chat("Write a haiku about rain.", 8, temperature=0.9, seed=7)


def post(url: str, path: str, body: dict, timeout: float = 300):
    """``(status, JSON body or the list of stream events)``."""
    parts = urlsplit(url)
    connection = HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    connection.request(
        "POST", parts.path + path, json.dumps(body), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    raw = response.read().decode()
    connection.close()
    if body.get("stream"):
        events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
        return response.status, [json.loads(e) for e in events if e != "[DONE]"]
    return response.status, json.loads(raw)


def answer(status_and_body) -> object:
    """What must agree: the body without ids, times, usage or decoding statistics."""
    status, body = status_and_body
    if isinstance(body, list):  # a stream: its text
        return status, "".join(
            c["choices"][0]["delta"].get("content") or "" for c in body if c["choices"]
        )

    def strip(value):
        if isinstance(value, dict):
            drop = {"id", "created", "created_at", "usage", "call_id", "system_fingerprint"}
            return {k: strip(v) for k, v in value.items() if k not in drop}
        if isinstance(value, list):
            return [strip(v) for v in value]
        if isinstance(value, float):
            return round(value, 2)
        return value

    return status, strip(body)


def child_pids(root: int) -> list:
    """Every descendant of process ``root``."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def rank_pid(launcher: int, rank: int) -> int:
    for pid in child_pids(launcher):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # the rank itself, not the shell that started it or its watchdog
        if f"MLX_RANK={rank}".encode() in environ and command[1:3] == [b"-m", b"server"]:
            return pid
    raise LookupError(f"no rank {rank} under {launcher}")


def serve(ranks: int, *flags, port: str = "0"):
    """A sharded server under ``python -m distributed.launch``; returns ``(process, url)``."""
    env = {k: v for k, v in os.environ.items() if k not in fast_blas.THREAD_VARIABLES}
    process = start_process(
        [sys.executable, "-m", "distributed.launch", "-n", str(ranks), "--backend", "ring",
         "-p", str(free_port(ranks)), "--", sys.executable, "-m", "server", "--port", port,
         "--max-tokens", "32", "--dist-timeout", str(DIST_TIMEOUT), *flags],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=ROOT, env=env,
    )  # fmt: skip
    return serving(process)


def serving(process) -> tuple:
    """``(process, url)`` once ``process`` prints its "serving MODEL on URL" line."""
    line = process.stdout.readline()
    if not line.startswith("serving"):
        process.terminate()
        try:
            errors = process.communicate(timeout=30)[1]
        finally:
            stop(process)
        pytest.fail(f"the server did not start: {line}{errors[-2000:]}")
    return process, line.split()[-1]


def one_process(*flags):
    process = start_process(
        [sys.executable, "-m", "server", "--port", "0", "--max-tokens", "32", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    return serving(process)


@pytest.fixture(scope="module")
def expected(embedded):
    """The one-process server's answers, each request sent alone, without draft sources: the
    sharded servers draft, and drafts never change the output."""
    process, url = one_process()
    try:
        return [answer(post(url, *request)) for request in REQUESTS]
    finally:
        stop(process)


@pytest.fixture(scope="module")
def pipeline(embedded):
    process, url = serve(2, "--shard", "pipeline", *SOURCES)
    yield process, url
    stop(process)


def test_pipeline_answers_concurrent_requests_of_every_kind_as_one_process(expected, pipeline):
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        got = list(pool.map(lambda request: answer(post(pipeline[1], *request)), REQUESTS))
    for request, want, have in zip(REQUESTS, expected, got):
        assert have == want, request
    # The prompt cache and the draft sources took part.
    status, body = post(pipeline[1], *REQUESTS[1])
    decoding = body["usage"]["decoding"]
    assert status == 200 and decoding["draft_accepted"] > 0
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_bad_request_is_refused_on_rank_0_and_serving_goes_on(pipeline):
    status, body = post(pipeline[1], "/chat/completions", {"model": MODEL, "messages": [],
                                                            "temperature": 5})  # fmt: skip
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert post(pipeline[1], *chat("Hi", 2))[0] == 200


def test_a_client_that_leaves_mid_stream_leaves_every_rank(pipeline):
    parts = urlsplit(pipeline[1])
    connection = HTTPConnection(parts.hostname, parts.port, timeout=60)
    path, body = chat("Write a long story.", 4000, stream=True)
    connection.request("POST", parts.path + path, json.dumps(body),
                       {"Content-Type": "application/json"})  # fmt: skip
    response = connection.getresponse()
    assert [response.readline().startswith(b"data:") for _ in range(4)].count(True) == 2
    connection.close()
    # 4000 tokens take many minutes: the next answer comes once every rank has dropped the row.
    start = time.perf_counter()
    assert post(pipeline[1], *chat("Hi", 2))[0] == 200
    assert time.perf_counter() - start < 30


def test_a_killed_rank_fails_open_requests_and_ends_the_launch_in_one_line(pipeline):
    process, url = pipeline
    parts = urlsplit(url)
    connection = HTTPConnection(parts.hostname, parts.port, timeout=60)
    path, body = chat("Write a long story.", 4000, stream=True)
    connection.request("POST", parts.path + path, json.dumps(body),
                       {"Content-Type": "application/json"})  # fmt: skip
    response = connection.getresponse()
    assert response.readline().startswith(b"data:")
    start = time.perf_counter()
    os.kill(rank_pid(process.pid, 1), signal.SIGKILL)
    rest = response.read().decode()
    events = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
    assert events and "error" in events[-1], rest[-500:]
    assert "lost a rank" in events[-1]["error"]["message"]
    _, stderr = process.communicate(timeout=DIST_TIMEOUT + 10)
    assert process.returncode != 0 and time.perf_counter() - start < DIST_TIMEOUT + 5
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(r"rank \d", errors[0]), stderr[-2000:]


@pytest.fixture(scope="module")
def tiny_for_3_ranks(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer, whose heads (6 and 3) and widths divide by 3,
    saved where ``--model`` reads it: tensor sharding over 3 ranks is about the split and the
    collectives, whatever the size, and the embedded model's 9 query heads need 3
    ranks that share these 2 cores at every all-reduce (test_distributed.py runs it)."""
    from tests.architectures import build, save

    widths = dict(hidden_size=96, intermediate_size=96)  # transformers wants heads * head_dim
    model, config = build("llama", num_attention_heads=6, num_key_value_heads=3, **widths)
    return save(tmp_path_factory.mktemp("tiny") / "tiny-llama", model, config)


def on_model(request: tuple, name: str) -> tuple:
    path, body = request
    return path, {**body, "model": name}


def test_tensor_sharding_over_3_ranks_answers_as_one_process_a_seed_repeats_and_a_stall_ends_it(
    tiny_for_3_ranks,
):
    """Plain decoding (forced text aside): a draft source that sizes its drafts by measured
    timings consumes the random stream differently from run to run, so only a plain server's
    sampling repeats exactly (docs/distributed.md). Then a rank stops answering."""
    name = str(tiny_for_3_ranks)  # the server's model id: the --model it was given
    flags = ["--model", name]
    requests = [on_model(REQUESTS[i], name) for i in (0, 7)]  # a chat, completions with logprobs
    process, url = one_process(*flags)
    try:
        expected = [answer(post(url, *request)) for request in requests]
    finally:
        stop(process)
    process, url = serve(3, "--shard", "tensor", *flags)
    try:
        with ThreadPoolExecutor(len(requests)) as pool:
            got = list(pool.map(lambda request: answer(post(url, *request)), requests))
        sampled = on_model(SAMPLED, name)
        runs = [post(url, *sampled) for _ in range(2)]
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(post, url, *on_model(chat("Write a long story.", 4000), name))
            time.sleep(3)
            start = time.perf_counter()
            os.kill(rank_pid(process.pid, 2), signal.SIGSTOP)
            status, body = waiting.result(timeout=DIST_TIMEOUT + 30)
        process.communicate(timeout=DIST_TIMEOUT + 10)
    finally:
        stop(process)
    assert [status for status, _ in expected] == [200, 200] and got == expected
    texts = [body["choices"][0]["message"]["content"] for _, body in runs]
    assert [status for status, _ in runs] == [200, 200] and texts[0] == texts[1], runs
    assert status == 503 and "lost a rank" in body["error"]["message"]
    assert process.returncode != 0 and time.perf_counter() - start < DIST_TIMEOUT + 10


def test_a_taken_port_ends_every_rank_in_one_line(embedded):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {k: v for k, v in os.environ.items() if k not in fast_blas.THREAD_VARIABLES}
        result = subprocess.run(
            [sys.executable, "-m", "distributed.launch", "-n", "2", "--backend", "ring", "-p",
             str(free_port(2)), "--", sys.executable, "-m", "server", "--port",
             str(taken.getsockname()[1])],
            stdin=subprocess.PIPE, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
        )  # fmt: skip
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cannot listen on 127.0.0.1" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
