"""Regex-constrained decoding in the loop: outputs match, forced drafts and other sources stay
lossless."""

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from constrained import ForcedTextSource, RegexConstraint, TokenSplits
from decoder import DecodingStats, Sampling, generate
from tests.helpers import ScriptedSource, tiny_byte_tokenizer, tiny_llama

TOKENIZER = tiny_byte_tokenizer()
VOCAB = len(TOKENIZER)
MODEL = tiny_llama(vocab_size=VOCAB, num_layers=2, hidden_size=32, seed=7, sharp=3.0)
REGEXES = [
    r"\d{4}-\d{2}-\d{2}",
    r'\{"name": "[a-z]{1,8}", "age": \d{1,3}\}',
    r"(yes|no|maybe)",
    r"[a-c]+@example\.com",
    r"(ab)*c?",
    r"café|日本語!",
]


def constrained(
    pattern,
    prompt,
    sources=(),
    model=MODEL,
    tokenizer=TOKENIZER,
    max_tokens=48,
    splits=None,
    **kwargs,
):
    constraint = RegexConstraint.from_regex(
        pattern, tokenizer, vocab_size=model.args.vocab_size, splits=splits
    )
    sources = [s(constraint) if callable(s) and not hasattr(s, "propose") else s for s in sources]
    return generate(
        model,
        tokenizer,
        prompt,
        constraint=constraint,
        draft_sources=sources,
        max_tokens=max_tokens,
        stats=DecodingStats(),
        **kwargs,
    )


def forced(constraint):
    return ForcedTextSource(constraint)


SHARED_SPLITS = TokenSplits(TOKENIZER)  # learned across the examples, as a server's across requests


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pattern=st.sampled_from(REGEXES),
    prompt=st.lists(st.integers(0, 255), min_size=1, max_size=8),
    seed=st.integers(0, 1000),
)
def test_forced_drafts_and_random_drafts_give_plain_constrained_output(pattern, prompt, seed):
    import random

    reference = constrained(pattern, prompt)
    if reference.finish_reason == "stop":
        assert re.fullmatch(pattern, reference.text, re.ASCII), reference.text
    rng = random.Random(seed)
    noise = ScriptedSource(lambda tokens, k: [rng.randrange(VOCAB) for _ in range(k)], name="noise")
    for sources in ([forced], [forced, noise], [noise]):
        assert constrained(pattern, prompt, sources).tokens == reference.tokens
    shared = constrained(pattern, prompt, [forced], splits=SHARED_SPLITS)
    assert shared.tokens == reference.tokens


def test_forced_text_costs_fewer_passes_than_tokens():
    pattern = r'\{"name": "[a-z]{1,8}", "age": \d{1,3}\}'
    plain = constrained(pattern, [5, 6, 7])
    fast = constrained(pattern, [5, 6, 7], [forced])
    assert fast.tokens == plain.tokens and re.fullmatch(pattern, fast.text)
    assert fast.stats.target_forward_passes < fast.generation_tokens
    assert plain.stats.target_forward_passes == plain.generation_tokens
    assert "regex" in fast.sources


def test_token_splits_learn_the_pieces_the_target_writes_and_forget_them():
    quote_colon, quote, colon = TOKENIZER.encode('":'), TOKENIZER.encode('"'), TOKENIZER.encode(":")
    assert len(quote_colon) == 1  # one merged token
    splits = TokenSplits(TOKENIZER)
    splits.learn(quote_colon[0], TOKENIZER.encode("ab")[0])  # not a piece of it: nothing learned
    splits.learn(quote[0], quote_colon[0])  # longer than the drafted token: nothing learned
    assert splits.apply(quote_colon + quote) == quote_colon + quote
    splits.learn(quote_colon[0], quote[0])  # the target wrote '"' where '":' was drafted
    assert splits.apply(quote + quote_colon) == quote + quote + colon
    # then it wrote the whole token where the piece was drafted
    splits.learn(quote[0], quote_colon[0])
    assert splits.apply(quote_colon) == quote_colon


def test_token_splits_follow_the_token_before():
    """A model may split a token after one token and write it whole after another (SmolLM2 writes an
    object's first ``{"`` as ``{`` then ``"``, a nested one whole): each context keeps its own
    habit, and a context not seen yet gets the latest seen anywhere."""
    quote_colon, quote, colon = TOKENIZER.encode('":'), TOKENIZER.encode('"'), TOKENIZER.encode(":")
    assert len(quote_colon) == 1
    after_a, after_b, unseen = TOKENIZER.encode("a")[0], TOKENIZER.encode("b")[0], 6
    splits = TokenSplits(TOKENIZER)
    splits.learn(quote_colon[0], quote[0], after_a)  # '"' then ':' after 'a'
    # not seen after 'b': the latest habit
    assert splits.apply(quote_colon, after_b) == quote + colon
    splits.learn(quote[0], quote_colon[0], after_b)  # but after 'b' it wrote '":' whole
    assert splits.apply(quote_colon, after_a) == quote + colon
    assert splits.apply(quote_colon, after_b) == quote_colon
    assert splits.apply(quote_colon, unseen) == quote_colon  # the latest seen anywhere: whole


def test_forced_text_is_drafted_the_way_the_target_wrote_it_before():
    pattern = '"name": "ab"'
    splits, prompt = TokenSplits(TOKENIZER), [5, 6]
    first = ForcedTextSource(RegexConstraint.from_regex(pattern, TOKENIZER, VOCAB, splits=splits))
    draft = first.propose(prompt, 32).tokens
    assert TOKENIZER.decode(draft) == pattern
    at = draft.index(TOKENIZER.encode('":')[0])
    # the target wrote '"' there
    first.update(prompt + draft[:at] + TOKENIZER.encode('"'), len(draft), at)
    second = ForcedTextSource(RegexConstraint.from_regex(pattern, TOKENIZER, VOCAB, splits=splits))
    again = second.propose(prompt, 32).tokens
    assert TOKENIZER.decode(again) == pattern
    assert again[: at + 2] == draft[:at] + TOKENIZER.encode('"') + TOKENIZER.encode(":")


def test_eos_only_in_accepting_states_and_generation_ends_there():
    result = constrained(r"(ab)+", [1, 2, 3], max_tokens=64)
    assert result.finish_reason == "stop" and result.tokens[-1] == TOKENIZER.eos_token_id
    assert re.fullmatch(r"(ab)+", result.text)


def test_sampled_output_matches_too():
    import mlx.core as mx

    for seed in range(5):
        mx.random.seed(seed)
        result = constrained(r"\d{4}-\d{2}-\d{2}", [9, 9], [forced], sampling=Sampling(1.0))
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", result.text)


# --- the embedded model ----------------------------------------------------------------

EMBEDDED_CASES = [
    ("Give me a date", r"\d{4}-\d{2}-\d{2}"),
    ("What is your phone number?", r"\(\d{3}\) \d{3}-\d{4}"),
    ("Describe a person as JSON", r'\{"name": "[a-zA-Z ]{1,20}", "age": \d{1,3}\}'),
    ("Is the sky blue? Answer yes or no.", r"(yes|no)"),
    ("Write a greeting with an emoji", r"[A-Za-z ,!]{1,30} (😀|🙂|👋)"),
]


@pytest.mark.parametrize("question,pattern", EMBEDDED_CASES)
def test_embedded_model_output_matches_and_drafts_are_lossless(
    embedded, chat_prompt, question, pattern, tmp_path
):
    from prompt_lookup import PromptLookupSource

    model, tokenizer, _ = embedded
    prompt = chat_prompt(question)

    def run(sources):
        return constrained(
            pattern, prompt, sources, model=model, tokenizer=tokenizer, max_tokens=64
        )

    plain = run([])
    assert plain.finish_reason == "stop" and re.fullmatch(pattern, plain.text, re.ASCII), plain.text
    with_forced = run([forced])
    combined = run([forced, PromptLookupSource()])
    assert with_forced.tokens == plain.tokens == combined.tokens
    assert with_forced.stats.target_forward_passes <= plain.stats.target_forward_passes


def test_sampling_with_a_source_that_ignores_the_regex_keeps_the_masked_distribution():
    from tests.helpers import assert_constrained_sampling_is_exact

    assert_constrained_sampling_is_exact(
        MODEL, RegexConstraint.from_regex("[a-e]{2}", TOKENIZER, vocab_size=VOCAB)
    )
