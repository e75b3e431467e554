"""The server on a tiny random model (tests/tiny_server.py), as a subprocess: logprobs against the
model's own log_softmax, clients that hang up mid-body, and many clients at once.

No real model loads, so these run in seconds; tests/test_server.py covers the embedded model.
"""

import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from decoder import generate_step
from tests import tiny_server
from tests.helpers import start_process, stop

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = tiny_server.tokenizer()
VOCAB = tiny_server.vocab_size()
MODEL = tiny_server.model()
EOS = TOKENIZER.eos_token_id
PROMPT = TOKENIZER.encode("name: ab 12 20 ab name: ab 12")


def start(log_dir: Path, *flags):
    log = log_dir / "stderr.txt"
    with open(log, "w") as stderr:
        process = start_process(
            [sys.executable, "-m", "tests.tiny_server", *flags],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    line = process.stdout.readline()
    if not line.startswith("serving"):
        stop(process)
        pytest.fail(f"the tiny server did not start: {line}{log.read_text()[-2000:]}")
    return process, line.split()[-1], log


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    process, url, log = start(tmp_path_factory.mktemp("plain"), "--max-queue", "32")
    yield process, url, log
    stop(process)


@pytest.fixture(scope="module")
def lookup(tmp_path_factory):
    process, url, log = start(tmp_path_factory.mktemp("lookup"), "--prompt-lookup")
    yield process, url, log
    stop(process)


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """Lookup drafting trees of up to 8 nodes (docs/draft_trees.md)."""
    flags = ("--prompt-lookup", "--tree-nodes", "8")
    process, url, log = start(tmp_path_factory.mktemp("trees"), *flags)
    yield process, url, log
    stop(process)


def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[1], api_key="none", max_retries=0, timeout=60)


def greedy_with_logprobs(prompt: list, max_tokens: int) -> tuple:
    """The oracle: the tokens decoded alone, and a plain log_softmax of the model's logits over the
    whole sequence at each of them (EOS not included, as the server leaves it out)."""
    tokens = [
        t for t, _ in generate_step(prompt, MODEL, eos_token_ids=[EOS], max_tokens=max_tokens)
    ]
    tokens = tokens[:-1] if tokens[-1] == EOS else tokens
    logits = MODEL(mx.array([prompt + tokens]))[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    return tokens, np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def token_string(token: int) -> str:
    from constrained.token_index import token_byte_strings

    return token_byte_strings(TOKENIZER, VOCAB)[token].decode("utf-8", errors="replace")


def test_completion_logprobs_are_the_models_with_and_without_prompt_lookup(plain, lookup, trees):
    tokens, want = greedy_with_logprobs(PROMPT, 24)
    answers = []
    for server in (plain, lookup, trees):
        answer = client(server).completions.create(
            model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=3
        )
        answers.append(answer)
        logprobs = answer.choices[0].logprobs
        assert logprobs.tokens == [token_string(t) for t in tokens]
        assert (
            np.abs(np.array(logprobs.token_logprobs) - want[np.arange(len(tokens)), tokens]).max()
            < 1e-5
        )
        for token, top, row in zip(logprobs.tokens, logprobs.top_logprobs, want):
            # Greedy: the chosen token is the top one. Tokens of a partial UTF-8 character all read
            # "\ufffd", so they share one key of the dict (hence <= 3).
            assert 1 <= len(top) <= 3 and top[token] == max(top.values())
            assert all(
                np.isclose(np.sort(row)[::-1][:3], value, atol=1e-5).any() for value in top.values()
            )
        lengths = [len(token) for token in logprobs.tokens]
        assert logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
        streamed = list(
            client(server).completions.create(
                model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=3, stream=True
            )
        )
        parts = [
            chunk.choices[0].logprobs for chunk in streamed if chunk.choices[0].logprobs is not None
        ]
        assert [t for p in parts for t in p.tokens] == logprobs.tokens
        assert [o for p in parts for o in p.text_offset] == logprobs.text_offset
        assert np.allclose(
            [v for p in parts for v in p.token_logprobs], logprobs.token_logprobs, atol=1e-6
        )
    assert answers[0].choices[0].text == answers[1].choices[0].text == answers[2].choices[0].text
    # prompt lookup drafted some tokens, as chains and as trees
    assert answers[1].usage.model_extra["decoding"]["draft_accepted"] > 0
    assert answers[2].usage.model_extra["decoding"]["draft_accepted"] > 0


def test_chat_logprobs_have_openais_shape_streamed_or_not(plain):
    api = client(plain)
    messages = [{"role": "user", "content": "ab 12 ab 12"}]
    answer = api.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=4
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens - (
        answer.choices[0].finish_reason == "stop"
    )
    for entry in content:
        assert (
            isinstance(entry.token, str)
            and bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
        )
        values = [top.logprob for top in entry.top_logprobs]
        assert len(values) == 4 and values == sorted(values, reverse=True) and values[0] <= 0
        assert (
            entry.top_logprobs[0].token == entry.token
            and entry.top_logprobs[0].logprob == entry.logprob
        )
    streamed = list(
        api.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=12,
            temperature=0,
            logprobs=True,
            top_logprobs=4,
            stream=True,
        )
    )
    pieces = [
        e
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.model_dump() for e in pieces] == [e.model_dump() for e in content]
    assert (
        api.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
        .choices[0]
        .logprobs
        is None
    )
    only = api.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, temperature=0, logprobs=True
    )
    assert [e.top_logprobs for e in only.choices[0].logprobs.content] == [[]] * len(
        only.choices[0].logprobs.content
    )


def test_constrained_logprobs_name_only_allowed_tokens(plain):
    answer = client(plain).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "yes or no?"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"guided_regex": "(yes|no)"},
    )
    assert answer.choices[0].message.content in ("yes", "no")
    first = answer.choices[0].logprobs.content[0]
    assert first.top_logprobs and all(re.match("y|n", top.token) for top in first.top_logprobs)
    # The masked distribution: the allowed tokens' probabilities add up to one.
    assert abs(sum(np.exp(top.logprob) for top in first.top_logprobs) - 1) < 1e-4


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"logprobs": True, "top_logprobs": 21}, "'top_logprobs' must be between 0 and 20"),
        ({"top_logprobs": 2}, "'top_logprobs' needs 'logprobs': true"),
        ({"logprobs": 1}, "'logprobs' must be a boolean"),
    ],
)
def test_bad_logprobs_are_400_in_one_line(body, fragment):
    from server.protocol import parse_chat, parse_completion
    from server.request import ApiError

    with pytest.raises(ApiError) as caught:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], **body}, TOKENIZER, "tiny", 8)
    assert (
        caught.value.status == 400
        and fragment in caught.value.message
        and "\n" not in caught.value.message
    )
    with pytest.raises(ApiError, match="'logprobs' must be between 0 and 20"):
        parse_completion({"prompt": "hi", "logprobs": 21}, TOKENIZER, "tiny", 8)


def hang_up_mid_body(url: str, index: int):
    """Headers that promise 1000 bytes of body, part of it, then a closed socket (every other one
    reset at once, SO_LINGER 0, the rest closed the polite way)."""
    host, port = re.match(r"http://([^:/]+):(\d+)", url).groups()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        if index % 2:
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n" + b'{"model": "tiny", "prompt": "ab'[: index % 30]
        )


def test_clients_that_hang_up_mid_body_leave_no_traceback(plain):
    process, url, log = plain
    for index in range(20):
        hang_up_mid_body(url, index)
    time.sleep(1)  # the server notices the closed connections
    answer = client(plain).completions.create(
        model="tiny", prompt="ab", max_tokens=3, temperature=0
    )
    assert answer.usage.completion_tokens >= 1 and process.poll() is None
    text = log.read_text()
    assert "Traceback" not in text and "Exception" not in text, text[-3000:]


def rss_kib(pid: int) -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1))


def test_32_clients_128_requests_all_answered_and_memory_bounded(plain):
    """Two waves of 64 requests from 32 threads, streaming and not (the queue of 32 holds every
    waiting one, so none is refused); the server's RSS after the second wave is within a small bound
    of its RSS after the first (the prompt cache is bounded at 1 MiB by tests/tiny_server.py)."""
    api = client(plain)
    results, lock = [], threading.Lock()

    def one(index: int):
        prompt, max_tokens = f"{index % 7} ab {index}", 1 + index % 8
        if index % 2:
            chunks = list(
                api.completions.create(
                    model="tiny",
                    prompt=prompt,
                    max_tokens=max_tokens,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            result = (
                "stream",
                chunks[-1].usage.completion_tokens,
                max_tokens,
                chunks[-2].choices[0].finish_reason,
            )
        else:
            answer = api.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                temperature=0,
            )
            result = (
                "json",
                answer.usage.completion_tokens,
                max_tokens,
                answer.choices[0].finish_reason,
            )
        with lock:
            results.append(result)

    start = time.perf_counter()
    rss = []
    with ThreadPoolExecutor(max_workers=32) as pool:
        for wave in range(2):
            list(pool.map(one, range(wave * 64, wave * 64 + 64)))  # re-raises any failed request
            rss.append(rss_kib(plain[0].pid))
    assert time.perf_counter() - start < 60
    assert len(results) == 128 and {kind for kind, *_ in results} == {"stream", "json"}
    for kind, tokens, max_tokens, finish_reason in results:
        assert 1 <= tokens <= max_tokens and finish_reason in ("stop", "length")
        assert finish_reason == "stop" or tokens == max_tokens
    assert rss[1] - rss[0] < 32 * 1024, (
        f"RSS grew from {rss[0]} to {rss[1]} KiB over the second wave"
    )
    assert "Traceback" not in plain[2].read_text()
