"""OpenAI's ``n`` on the tiny random model's server (tests/tiny_server.py, --max-batch 4): greedy
choices are the n=1 answer, seeded sampled ones repeat, choice i is the n=1 answer with seed
seed + i, streams carry each choice's index and one usage, and a bad ``n`` is a 400 that names
it."""

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from tests.helpers import stop
from tests.test_server_tiny import PROMPT, client, start


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process, url, log = start(tmp_path_factory.mktemp("choices"), "--max-batch", "4")
    yield process, url, log
    stop(process)


def test_greedy_choices_are_the_n1_answer_with_logprobs_and_stop_strings(server):
    api = client(server)
    one = api.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, logprobs=2
    )
    three = api.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, logprobs=2, n=3
    )
    assert [c.index for c in three.choices] == [0, 1, 2]
    for choice in three.choices:
        assert choice.text == one.choices[0].text
        assert choice.finish_reason == one.choices[0].finish_reason
        assert choice.logprobs.tokens == one.choices[0].logprobs.tokens
        # rows of a batch of 3 against one alone: the same tokens, logprobs to float32 rounding
        assert np.allclose(
            choice.logprobs.token_logprobs, one.choices[0].logprobs.token_logprobs, atol=1e-5
        )
        assert choice.logprobs.text_offset == one.choices[0].logprobs.text_offset
    assert three.usage.prompt_tokens == one.usage.prompt_tokens == len(PROMPT)
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.total_tokens == len(PROMPT) + 3 * one.usage.completion_tokens
    # a stop string cuts every choice
    text = one.choices[0].text
    stop_at = next(c for c in text[2:] if not c.isspace() and c != "\ufffd")
    cut = api.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop_at], n=2
    )
    want = text[: text.index(stop_at)]
    assert [(c.text, c.finish_reason) for c in cut.choices] == [(want, "stop")] * 2
    messages = [{"role": "user", "content": "ab 12 ab 12"}]
    chat_one = api.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True
    )
    chat_two = api.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True, n=2
    )
    assert [c.index for c in chat_two.choices] == [0, 1]
    for choice in chat_two.choices:
        assert choice.message.content == chat_one.choices[0].message.content
        got, alone = choice.logprobs.content, chat_one.choices[0].logprobs.content
        assert [e.token for e in got] == [e.token for e in alone]
        assert np.allclose([e.logprob for e in got], [e.logprob for e in alone], atol=1e-5)


def test_seeded_sampled_choices_repeat_streamed_or_not(server):
    api = client(server)
    asked = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7, n=2)
    first, again = (api.completions.create(**asked) for _ in range(2))
    texts = [c.text for c in first.choices]
    assert [c.text for c in again.choices] == texts and [c.index for c in first.choices] == [0, 1]
    assert first.usage.completion_tokens == again.usage.completion_tokens
    chunks = list(
        api.completions.create(**asked, stream=True, stream_options={"include_usage": True})
    )
    streamed, finished = ["", ""], [None, None]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        streamed[choice.index] += choice.text
        if choice.finish_reason is not None:
            assert finished[choice.index] is None
            finished[choice.index] = choice.finish_reason
    assert streamed == texts
    assert finished == [c.finish_reason for c in first.choices]
    # one usage chunk, last, for both choices
    assert chunks[-1].choices == [] and [c.usage is not None for c in chunks] == [False] * (
        len(chunks) - 1
    ) + [True]
    assert chunks[-1].usage.completion_tokens == first.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == len(PROMPT)


def test_seeded_choice_i_is_the_n1_answer_with_seed_plus_i(server):
    api = client(server)
    asked = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0)
    three = api.completions.create(**asked, seed=2**64 - 2, n=3)
    alone = [
        api.completions.create(**asked, seed=seed).choices[0].text
        for seed in (2**64 - 2, 2**64 - 1, 0)
    ]
    assert [c.text for c in three.choices] == alone
    assert len(set(alone)) > 1  # the streams differ (a weak check, but it fails if they do not)


def test_chat_stream_carries_both_indices(server):
    chunks = list(
        client(server).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "ab"}],
            max_tokens=6,
            temperature=0,
            n=2,
            stream=True,
        )
    )
    assert {c.choices[0].index for c in chunks} == {0, 1}
    texts = ["", ""]
    for chunk in chunks:
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert texts[0] == texts[1]
    ends = [c.choices[0].index for c in chunks if c.choices[0].finish_reason is not None]
    assert sorted(ends) == [0, 1]


@pytest.mark.parametrize(
    "n, fragment",
    [
        (0, "'n' must be an integer between 1 and 8"),
        (9, "'n' must be an integer between 1 and 8"),
        (1.5, "'n' must be an integer"),
        ("2", "'n' must be an integer"),
        (5, "'n' must be at most 4"),  # the server's --max-batch
    ],
)
def test_bad_n_is_a_400_naming_n(server, n, fragment):
    for path, body in (
        ("/completions", {"prompt": "ab"}),
        ("/chat/completions", {"messages": [{"role": "user", "content": "ab"}]}),
    ):
        data = json.dumps({"model": "tiny", "n": n, **body}).encode()
        asked = urllib.request.Request(
            server[1] + path, data, headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(asked, timeout=30)
        error = json.loads(caught.value.read())["error"]
        assert caught.value.code == 400 and error["param"] == "n"
        assert fragment in error["message"], error
