"""Thinking on Qwen3's real tokenizer and shipped chat template (tests/data/qwen3-small: its first
4096 tokens and every added token), with a tiny random model of that vocabulary as the target; and a
Qwen3.5-style variant of the template that opens the think block in the prompt."""

import re

import mlx.core as mx
import pytest

from constrained.build import regex_constraint
from constrained.think_markers import think_markers
from constrained.thinking import (
    ANSWER,
    START,
    THINKING,
    ThinkingConstraint,
    ThinkingForcedSource,
    split_reasoning,
)
from decoder import Sampling, generate
from server.protocol import parse_chat
from tests.helpers import qwen3_small_tokenizer, tiny_llama

TOKENIZER, OPENS = qwen3_small_tokenizer(), qwen3_small_tokenizer(opens=True)
VOCAB = len(TOKENIZER)
MODEL = tiny_llama(vocab_size=VOCAB, seed=5, sharp=2.0)
MARKERS = think_markers(TOKENIZER)
HI = [{"role": "user", "content": "Name a city."}]


def prompt(tokenizer, **options):
    return tokenizer.apply_chat_template(HI, add_generation_prompt=True, **options)


def test_qwen3_markers_and_phases():
    assert (MARKERS.start, MARKERS.end) == ("<think>", "</think>")
    # the separator the template writes
    assert TOKENIZER.decode(list(MARKERS.close_tokens)) == "</think>\n\n"
    assert MARKERS.phase(prompt(TOKENIZER), TOKENIZER.decode) == START
    assert MARKERS.phase(prompt(TOKENIZER, enable_thinking=False), TOKENIZER.decode) == ANSWER
    assert MARKERS.phase(prompt(OPENS), OPENS.decode) == THINKING
    assert MARKERS.phase(prompt(OPENS, enable_thinking=False), OPENS.decode) == ANSWER


def test_qwen3_template_keeps_the_reasoning_of_a_tool_call_turn():
    messages = HI + [
        {
            "role": "assistant",
            "content": "",
            "reasoning": "Look it up.",
            "tool_calls": [{"function": {"name": "find", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "Paris"},
    ]
    request = parse_chat({"model": "q", "messages": messages}, TOKENIZER, "q", 8)
    assert "<think>\nLook it up.\n</think>\n\n<tool_call>" in TOKENIZER.decode(request.prompt)


@pytest.mark.parametrize("opens", [False, True])
def test_a_regex_answer_after_a_bounded_block(opens):
    tokenizer = OPENS if opens else TOKENIZER
    tokens = prompt(tokenizer)
    phase = MARKERS.phase(tokens, tokenizer.decode)
    for seed in range(4):
        inner, forced = regex_constraint(r"(Paris|Rome|Oslo)\.", tokenizer, VOCAB)
        constraint = ThinkingConstraint(MARKERS, VOCAB, inner, budget=6, phase=phase)
        mx.random.seed(seed)
        result = generate(
            MODEL,
            tokenizer,
            tokens,
            constraint=constraint,
            sampling=Sampling(1.0),
            max_tokens=40,
            draft_sources=[ThinkingForcedSource(constraint, forced)],
        )
        reasoning, answer = split_reasoning(result.text.replace("<|im_end|>", ""), MARKERS, phase)
        assert re.fullmatch(r"(Paris|Rome|Oslo)\.", answer), result.text
        if opens:
            assert (
                result.tokens[6:9] == list(MARKERS.close_tokens)
                or MARKERS.end_tokens[0] in result.tokens[:7]
            )
