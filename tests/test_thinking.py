"""Thinking models on the tiny random model: the think block found from the tokenizer and template,
bounded by a budget (its closing text forced and drafted for free), and constraints that start after
it."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from constrained.build import regex_constraint
from constrained.think_markers import think_markers
from constrained.thinking import (
    ANSWER,
    START,
    THINKING,
    ThinkingConstraint,
    ThinkingForcedSource,
    reasoning_token_count,
)
from decoder import DecodingStats, generate_step
from tests import tiny_server

TOKENIZER = tiny_server.tokenizer(thinking="opens")
OPTIONAL = tiny_server.tokenizer(thinking="optional")
MODEL = tiny_server.model(thinking=True)
VOCAB = tiny_server.vocab_size(thinking=True)
MARKERS = think_markers(TOKENIZER)
EOS = TOKENIZER.eos_token_id
THINK, END = MARKERS.start_tokens[0], MARKERS.end_tokens[0]


def prompt(tokenizer=TOKENIZER, **options):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a city."}], add_generation_prompt=True, **options
    )


def decode(constraint, max_tokens=60, sources=(), stats=None, tokens=None):
    tokens = prompt() if tokens is None else tokens
    return [
        t
        for t, _ in generate_step(
            tokens,
            MODEL,
            eos_token_ids=[EOS],
            constraint=constraint,
            draft_sources=list(sources),
            max_tokens=max_tokens,
            stats=stats,
        )
    ]


def test_markers_and_where_the_prompt_leaves_the_model():
    assert (MARKERS.start, MARKERS.end) == ("<think>", "</think>")
    # the separator read from the template
    assert TOKENIZER.decode(list(MARKERS.close_tokens)) == "</think>\n\n"
    assert MARKERS.phase(prompt(), TOKENIZER.decode) == THINKING
    assert MARKERS.phase(prompt(enable_thinking=False), TOKENIZER.decode) == ANSWER
    assert MARKERS.phase(prompt(OPTIONAL), OPTIONAL.decode) == START
    assert think_markers(tiny_server.tokenizer()) is None  # no think tokens: not a thinking model


def test_the_budget_closes_the_block_and_the_answer_follows():
    free = decode(None)
    assert END not in free  # the tiny model would think past max_tokens
    budget = 7
    tokens = decode(ThinkingConstraint(MARKERS, VOCAB, budget=budget, phase=THINKING))
    assert tokens[:budget] == free[:budget]  # unchanged until the budget is spent
    assert tokens[budget : budget + 3] == list(MARKERS.close_tokens)
    assert reasoning_token_count(tokens, MARKERS, THINKING) == budget
    assert len(tokens) > budget + 3  # an answer follows


def test_the_closing_text_is_drafted_for_free():
    constraint = ThinkingConstraint(MARKERS, VOCAB, budget=4, phase=THINKING)
    stats = DecodingStats()
    tokens = decode(constraint, sources=[ThinkingForcedSource(constraint)], stats=stats)
    assert tokens == decode(ThinkingConstraint(MARKERS, VOCAB, budget=4, phase=THINKING))
    # </think> is the target's, the separator drafted
    assert stats.sources["thinking"].accepted >= 2


def test_a_regex_starts_after_the_block():
    inner, forced = regex_constraint(r"(Paris|Rome)!", TOKENIZER, VOCAB)
    constraint = ThinkingConstraint(MARKERS, VOCAB, inner=inner, budget=5, phase=THINKING)
    tokens = decode(constraint, sources=[ThinkingForcedSource(constraint, forced)])
    text = TOKENIZER.decode([t for t in tokens if t != EOS])
    reasoning, answer = text.split("</think>\n\n")
    assert re.fullmatch(r"(Paris|Rome)!", answer) and "Paris" not in reasoning
    # free text, not the regex
    assert len(TOKENIZER.encode(reasoning, add_special_tokens=False)) >= 5 - 1


def test_no_budget_inside_a_constraint_is_free_until_the_model_closes():
    inner, _ = regex_constraint(r"[a-z]+", TOKENIZER, VOCAB)
    constraint = ThinkingConstraint(MARKERS, VOCAB, inner=inner, phase=THINKING)
    assert decode(constraint, max_tokens=30) == decode(None, max_tokens=30)


def test_a_block_the_model_may_open():
    """START: the model answers at once (the inner constraint's mask) or opens the block."""
    inner, _ = regex_constraint(r"x+", OPTIONAL, VOCAB)
    constraint = ThinkingConstraint(MARKERS, VOCAB, inner=inner, budget=2, phase=START)
    allowed = constraint.masks(constraint.walk([]))[0].tolist()
    assert allowed[THINK] and allowed[ord("x")] and not allowed[ord("y")]
    draft = [THINK, ord("a"), ord("b"), ord("c")]
    # the third thought token is past the budget: </think> is forced
    assert len(constraint.walk(draft)) == 4
    constraint.advance([THINK, ord("a"), ord("b")])
    assert constraint.forced_tokens() == list(MARKERS.close_tokens)
    constraint.advance(list(MARKERS.close_tokens) + [ord("x")])
    assert constraint.state.phase == ANSWER and constraint.walk([ord("y")]) == constraint.walk([])
    # thinking off: never opens
    off = ThinkingConstraint(MARKERS, VOCAB, inner=inner, budget=0, phase=START)
    assert not off.masks(off.walk([]))[0].tolist()[THINK]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from([THINK, END, 10, ord("a"), ord("x"), EOS]), max_size=12),
    st.sampled_from([START, THINKING]),
    st.sampled_from([None, 0, 1, 3]),
    st.booleans(),
)
def test_a_walk_agrees_with_advancing_token_by_token(draft, phase, budget, constrained):
    inner = regex_constraint(r"x+", TOKENIZER, VOCAB)[0] if constrained else None
    walked = ThinkingConstraint(MARKERS, VOCAB, inner=inner, budget=budget, phase=phase)
    masks = walked.masks(walked.walk(draft))
    stepped = ThinkingConstraint(
        MARKERS,
        VOCAB,
        inner=inner and regex_constraint(r"x+", TOKENIZER, VOCAB)[0],
        budget=budget,
        phase=phase,
    )
    for position in range(len(masks)):
        alone = stepped.masks(stepped.walk([]))[0]
        assert masks[position].tolist() == alone.tolist()
        if position < len(masks) - 1:
            assert alone.tolist()[draft[position]]
            stepped.advance([draft[position]])
    if len(masks) <= len(draft):  # the walk stopped at the first forbidden token
        assert not masks[-1].tolist()[draft[len(masks) - 1]]


@pytest.mark.parametrize(
    "phase, tokens, expected",
    [
        (THINKING, [1, 2, END, 10, 3], 2),
        (START, [THINK, 1, END, 4], 1),
        (START, [1, 2], 0),
        (ANSWER, [1, 2], 0),
    ],
)
def test_reasoning_tokens_are_counted_inside_the_block(phase, tokens, expected):
    assert reasoning_token_count(tokens, MARKERS, phase) == expected


# ---- main.py on a saved tiny thinking model ------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny thinking model and its tokenizer ("opens" template) where main.py --model reads
    them."""
    from mlx_lm.utils import save_config, save_model

    from tests.helpers import tiny_byte_tokenizer

    directory = tmp_path_factory.mktemp("thinking-model")
    save_model(directory, MODEL)
    save_config(
        {
            "model_type": "llama",
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "vocab_size": VOCAB,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        },
        directory / "config.json",
    )
    tokenizer = tiny_byte_tokenizer(thinking=True)
    tokenizer.chat_template = TOKENIZER.chat_template
    tokenizer.save_pretrained(directory)
    return directory


def run_main(model_dir, capsys, *flags):
    import json

    import main

    args = main.build_parser().parse_args(
        ["--model", str(model_dir), "--prompt", "Name a city.", "--json", *flags]
    )
    main.run(args)
    return json.loads(capsys.readouterr().out)


def test_main_thinking_budget_and_json_reasoning(model_dir, capsys):
    out = run_main(model_dir, capsys, "--thinking-budget", "4", "--max-tokens", "20")
    assert out["tokens"][4:7] == list(MARKERS.close_tokens)
    assert out["text"] == TOKENIZER.decode(out["tokens"])  # the whole output, as before
    reasoning, answer = out["text"].split("</think>\n\n")
    assert out["reasoning"] == reasoning.strip() and out["answer"] == answer
    free = run_main(model_dir, capsys, "--max-tokens", "20")
    # still thinking at max_tokens
    assert free["tokens"][:4] == out["tokens"][:4] and free["answer"] == ""


def test_main_regex_constrains_the_answer_after_thinking(model_dir, capsys):
    out = run_main(
        model_dir,
        capsys,
        "--regex",
        "(Paris|Rome)!",
        "--thinking-budget",
        "3",
        "--max-tokens",
        "30",
    )
    assert re.fullmatch(r"(Paris|Rome)!", out["answer"]) and out["reasoning"]
    # the separator and regex text drafted for free
    assert out["draft_sources"]["thinking"]["accepted"] >= 2
    off = run_main(
        model_dir, capsys, "--regex", "(Paris|Rome)!", "--no-thinking", "--max-tokens", "30"
    )
    assert re.fullmatch(r"(Paris|Rome)!", off["text"]) and off["reasoning"] == ""


def test_main_color_dims_the_reasoning(model_dir, capsys):
    import main

    args = main.build_parser().parse_args(
        [
            "--model",
            str(model_dir),
            "--prompt",
            "Name a city.",
            "--color",
            "always",
            "--thinking-budget",
            "2",
            "--max-tokens",
            "8",
        ]
    )
    main.run(args)
    shown = capsys.readouterr().out.split("\n==========")[0]
    assert shown.startswith(main.DIM) and main.DIM + main.COLORS["thinking"] + "</think>" in shown
    assert main.DIM not in shown.split("</think>")[-1]


def test_main_prints_carriage_returns_as_they_are(model_dir, capfd):
    """\\r\\n in the output reaches stdout as \\r\\n (bytes, not a terminal's rendering)."""
    import main

    args = main.build_parser().parse_args(
        [
            "--model",
            str(model_dir),
            "--prompt",
            "Two lines.",
            "--no-thinking",
            "--regex",
            "a\\r\\nb\\r\\n",
            "--max-tokens",
            "8",
        ]
    )
    main.run(args)
    assert capfd.readouterr().out.startswith("a\r\nb\r\n\n==========")


# ---- GPT-OSS's harmony channels ------------------------------------------------------------------

harmony_tokenizer = tiny_server.harmony_tokenizer


def test_harmony_analysis_is_reasoning_and_final_is_the_answer():
    from constrained.think_markers import HARMONY
    from constrained.thinking import split_reasoning

    tokenizer = harmony_tokenizer()
    markers = think_markers(tokenizer)
    assert (markers.start, markers.end, markers.separator) == HARMONY
    prompt_tokens = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert markers.phase(prompt_tokens, tokenizer.decode) == START
    # as if the model had opened its analysis channel
    opened = prompt_tokens + list(markers.start_tokens)
    assert markers.phase(opened, tokenizer.decode) == THINKING
    vocab = len(tokenizer)
    from tests.helpers import tiny_llama

    model = tiny_llama(vocab_size=vocab, seed=2)
    constraint = ThinkingConstraint(markers, vocab, budget=3, phase=THINKING)
    tokens = [
        t
        for t, _ in generate_step(
            opened, model, eos_token_ids=[], constraint=constraint, max_tokens=20
        )
    ]
    assert tokens[3 : 3 + len(markers.close_tokens)] == list(markers.close_tokens)
    text = tokenizer.decode(tokens)
    reasoning, answer = split_reasoning(text, markers, THINKING)
    assert reasoning == tokenizer.decode(tokens[:3]).strip() and "<|" not in answer
    assert answer == tokenizer.decode(tokens[3 + len(markers.close_tokens) :]).lstrip()
    # <|channel|> also opens the final channel
    off = ThinkingConstraint(markers, vocab, budget=0, phase=START)
    assert off.masks(off.walk([]))[0].tolist()[markers.start_tokens[0]]
    off.advance(list(markers.start_tokens))
    assert off.forced_tokens() == list(markers.close_tokens)
