"""The server's sampling controls (issue #50): OpenAI's penalties and logit_bias, mlx_lm.server's
extras and Anthropic's top_k reach the loop; out-of-range values are a 400 naming the field; a
request's row in a batch gives what it gives alone, and what mlx-lm gives with the same
processors."""

import asyncio

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step as mlx_generate_step
from mlx_lm.sample_utils import make_logits_processors

from server.anthropic_input import parse_messages
from server.protocol import check_prompt, parse_chat, parse_completion
from server.request import ApiError
from tests.test_server import outcome_of

MODEL = "tiny"


@pytest.fixture(scope="module")
def engine():
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from server.engine import Engine
    from tests.helpers import tiny_byte_tokenizer, tiny_llama

    tokenizer = tiny_byte_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    vocab_size = len(tokenizer)
    return Engine(
        tiny_llama(vocab_size=vocab_size, seed=7, sharp=3.0),
        TokenizerWrapper(tokenizer),
        vocab_size,
    )


def completion(engine, **fields):
    body = {"prompt": "ab ab ab ab", "temperature": 0, "max_tokens": 12, **fields}
    request = parse_completion(body, engine.tokenizer, MODEL, 64)
    check_prompt(request, None, engine.vocab_size)
    return request


def run_together(engine, requests) -> list:
    """The requests' generated tokens, submitted at once (rows of one batch)."""

    async def run():
        loop = asyncio.get_running_loop()
        jobs = [engine.submit(request, loop) for request in requests]
        return [(await outcome_of(job)).tokens for job in jobs]

    return asyncio.run(run())


CONTROLS = [
    {"presence_penalty": 1.5, "frequency_penalty": 0.7},
    {"repetition_penalty": 1.8, "repetition_context_size": 4},
    {"logit_bias": {"98": 10, "32": -100}},
    {"frequency_penalty": -1.0, "frequency_context_size": 3, "top_k": 3, "min_p": 0.1},
    {},
]


def test_each_row_of_a_batch_gives_what_it_gives_alone_and_what_mlx_lm_gives(engine):
    requests = [completion(engine, **fields) for fields in CONTROLS]
    together = run_together(engine, requests)
    for fields, request, tokens in zip(CONTROLS, requests, together):
        assert run_together(engine, [request]) == [tokens], fields
        settings = {
            name: value
            for name, value in fields.items()
            if name not in ("top_k", "min_p", "logit_bias")
        }
        if "logit_bias" in fields:
            settings["logit_bias"] = {int(k): float(v) for k, v in fields["logit_bias"].items()}
        steps = mlx_generate_step(
            mx.array(request.prompt),
            engine.model,
            max_tokens=12,
            logits_processors=make_logits_processors(**settings),
        )
        expected = [token for token, _ in steps]
        assert tokens == expected[: len(tokens)], fields
    # the controls change the output (else the comparison above says nothing)
    assert len({tuple(tokens) for tokens in together}) == len(CONTROLS)


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": True}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"xtc_probability": -0.1}, "xtc_probability"),
        ({"xtc_threshold": 0.6}, "xtc_threshold"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"repetition_context_size": -1}, "repetition_context_size"),
        ({"presence_context_size": "20"}, "presence_context_size"),
        ({"frequency_context_size": 2.0}, "frequency_context_size"),
    ],
)
def test_out_of_range_controls_are_a_400_naming_the_field(engine, fields, param):
    for parse in (completion, chat):
        with pytest.raises(ApiError) as error:
            parse(engine, **fields)
        assert error.value.status == 400 and error.value.param == param
        assert param in error.value.message


def chat(engine, **fields):
    body = {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 4, **fields}
    request = parse_chat(body, engine.tokenizer, MODEL, 64)
    check_prompt(request, None, engine.vocab_size)
    return request


def test_the_controls_reach_the_row(engine):
    request = chat(
        engine,
        temperature=0.7,
        top_k=5,
        min_p=0.05,
        xtc_probability=0.5,
        xtc_threshold=0.2,
        presence_penalty=0.5,
        logit_bias={"7": -100},
    )
    sampling = request.sampling
    assert (sampling.top_k, sampling.min_p, sampling.xtc_threshold) == (5, 0.05, 0.2)
    newline = engine.tokenizer.encode("\n", add_special_tokens=False)
    assert set(newline) <= set(sampling.xtc_special_tokens)
    assert len(request.logits_processors()) == 2  # logit_bias and the presence penalty
    messages = parse_messages(
        {"max_tokens": 4, "top_k": 3, "messages": [{"role": "user", "content": "ab"}]},
        engine.tokenizer,
        MODEL,
        64,
    )
    assert messages.sampling.top_k == 3


def test_a_sampled_request_with_controls_and_a_seed_repeats(engine):
    request = completion(engine, temperature=1.0, top_k=4, min_p=0.05, seed=3, presence_penalty=1)
    first = run_together(engine, [request])
    assert run_together(engine, [request]) == first


def test_n_choices_prefill_the_prompt_once(engine):
    """A request's n choices: the prompt runs through the model once and its cache is copied to
    each row; greedy, each choice is the n=1 answer."""
    from dataclasses import replace

    from server.choices import choice_requests

    request = replace(completion(engine, prompt="zq 97 zq 97 zq"), num_choices=3)

    async def run():
        jobs = engine.submit_together(
            choice_requests(request), asyncio.get_running_loop(), [None] * 3
        )
        return [await outcome_of(job) for job in jobs]

    before = engine.generator.stats.prefilled_tokens
    outcomes = asyncio.run(run())
    cached = outcomes[0].cached_tokens
    assert {outcome.cached_tokens for outcome in outcomes} == {cached}
    assert engine.generator.stats.prefilled_tokens - before == len(request.prompt) - 1 - cached
    alone = run_together(engine, [replace(request, num_choices=1)])
    assert [outcome.tokens for outcome in outcomes] == alone * 3
