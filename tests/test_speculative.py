"""Speculative decoding with a draft model: lossless greedy, exact sampling, T5 pairs, vocabulary
checks."""

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decoder import DecodingStats, generate_step
from decoder.pass_cost import PassCost
from draft_model import DraftModel, VocabularyMismatch
from t5 import T5Decoder, load_t5
from tests.helpers import assert_sampling_keeps_the_target_distribution, count_trees, tiny_llama
from tests.t5_fixtures import make_tiny_t5_dir, train_tiny_spiece
from tests.test_cli import assert_one_line_error, cli

VOCAB = 64
TARGET = tiny_llama(vocab_size=VOCAB, num_layers=3, seed=0)
DRAFT = tiny_llama(vocab_size=VOCAB, num_layers=1, seed=5)


def tokens_of(prompt, model, sources=(), **kwargs):
    return [
        t
        for t, _ in generate_step(
            prompt, model, draft_sources=list(sources), eos_token_ids=(), **kwargs
        )
    ]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),
    num_draft=st.integers(1, 6),
    adaptive=st.booleans(),
    min_confidence=st.sampled_from([0.0, 0.3, 0.9]),
    max_tokens=st.integers(1, 30),
)
def test_greedy_draft_model_output_equals_plain(
    prompt, num_draft, adaptive, min_confidence, max_tokens
):
    reference = tokens_of(prompt, TARGET, max_tokens=max_tokens)
    for draft_model in (DRAFT, TARGET):  # a weak draft and a perfect one
        source = DraftModel(
            draft_model,
            VOCAB,
            num_draft=num_draft,
            adaptive=adaptive,
            min_confidence=min_confidence,
        ).source()
        assert tokens_of(prompt, TARGET, [source], max_tokens=max_tokens) == reference


def test_a_perfect_draft_is_always_accepted_and_grows():
    stats = DecodingStats()
    source = DraftModel(
        TARGET, VOCAB, num_draft=2, adaptive=True, max_draft=8, min_confidence=0.0
    ).source()
    # A clock that stands still: the costs stay at their priors (a self-draft costs a whole step
    # here).
    tokens_of(
        [1, 2, 3],
        TARGET,
        [source],
        max_tokens=40,
        stats=stats,
        pass_cost=PassCost(clock=lambda: 0.0),
    )
    assert stats.draft_accepted == stats.draft_proposed > 0
    assert source.num_draft == 8
    assert stats.target_forward_passes < 40 / 4


def test_draft_cache_follows_the_accepted_tokens():
    source = DraftModel(DRAFT, VOCAB, num_draft=4).source()
    out = tokens_of([4, 5, 6], TARGET, [source], max_tokens=25)
    # After the last update the draft cache holds a prefix of the accepted text, never rejected
    # tokens.
    accepted = [4, 5, 6] + out
    drafter = source.drafter
    held = drafter.texts[0][: drafter.counts[0]]
    assert held == accepted[: len(held)] and drafter.cache.held(0) == len(held) > 3


# temp 1 without truncation: the draft model's trees below, and test_decoder.py's random draft model
@pytest.mark.parametrize("temp,top_p", [(0.8, 0.9)])
def test_sampling_with_a_draft_model_keeps_the_target_distribution(temp, top_p):
    target = tiny_llama(vocab_size=8, num_layers=2, seed=3, sharp=2.0)
    draft = tiny_llama(vocab_size=8, num_layers=1, seed=9, sharp=2.0)

    def make_run():
        return target, [DraftModel(draft, 8, num_draft=2, adaptive=False).source()]

    assert_sampling_keeps_the_target_distribution(target, make_run, temp, top_p)


def test_sampling_with_draft_model_trees_keeps_the_target_distribution():
    """A draft model's trees (its q-drawn chain turned greedy, the model's next choices as leaves)
    verified by the multi-candidate rule."""
    target = tiny_llama(vocab_size=8, num_layers=2, seed=3, sharp=2.0)
    draft = tiny_llama(vocab_size=8, num_layers=1, seed=9, sharp=2.0)
    trees = []

    def make_run():
        source = DraftModel(draft, 8, num_draft=2, adaptive=False).source()
        return target, [count_trees(source, trees)]

    assert_sampling_keeps_the_target_distribution(
        target, make_run, 1.0, 1.0, runs=1500, tree_nodes=4
    )
    assert any(trees)  # trees were verified, not only chains


# --- T5 ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def t5_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5")
    spiece = train_tiny_spiece(root / "spiece.model")
    large = make_tiny_t5_dir(root / "large", "v1.1", seed=1, num_layers=3, spiece_model=spiece)
    small = make_tiny_t5_dir(root / "small", "v1.1", seed=2, num_layers=1, spiece_model=spiece)
    return large, small


def test_t5_speculative_greedy_equals_plain_greedy(t5_pair):
    from prompt_lookup import PromptLookupSource

    large, small = (load_t5(path) for path in t5_pair)
    (target, tokenizer), (draft, draft_tokenizer) = large, small
    encoder_input = tokenizer.encode("the quick brown fox jumps over the lazy dog")
    decoder = T5Decoder(target, encoder_input)
    reference = tokens_of(decoder.prompt_tokens(), decoder, max_tokens=30)
    for draft_model in (draft, target):
        for with_lookup in (False, True):
            # Sources follow one generation, so each run gets fresh ones.
            sources = [
                DraftModel.create(
                    draft_model,
                    draft_tokenizer,
                    target,
                    tokenizer,
                    encoder_input=encoder_input,
                    num_draft=3,
                ).source()
            ]
            if with_lookup:
                sources.insert(0, PromptLookupSource(extra_context=encoder_input))
            assert tokens_of(decoder.prompt_tokens(), decoder, sources, max_tokens=30) == reference


@pytest.mark.slow
def test_t5_pair_from_the_command_line(t5_pair):
    large, small = t5_pair
    plain = cli(
        "--model", str(large), "--prompt", "the quick brown fox", "--max-tokens", "20", "--json"
    )
    assert plain.returncode == 0, plain.stderr
    fast = cli(
        "--model",
        str(large),
        "--draft-model",
        str(small),
        "--prompt-lookup",
        "--prompt",
        "the quick brown fox",
        "--max-tokens",
        "20",
        "--json",
    )
    assert fast.returncode == 0, fast.stderr
    plain, fast = json.loads(plain.stdout), json.loads(fast.stdout)
    assert fast["tokens"] == plain["tokens"]
    assert fast["draft_proposed"] > 0


@pytest.mark.slow
def test_vocabulary_mismatch_is_refused(t5_pair, tmp_path):
    other = make_tiny_t5_dir(
        tmp_path / "other",
        "v1.1",
        seed=3,
        num_layers=1,
        spiece_model=train_tiny_spiece(tmp_path / "other.model", vocab_size=80),
    )
    (target, tokenizer), (draft, draft_tokenizer) = load_t5(t5_pair[0]), load_t5(other)
    with pytest.raises(VocabularyMismatch):
        DraftModel.create(draft, draft_tokenizer, target, tokenizer, encoder_input=[1])
    result = cli("--model", str(t5_pair[0]), "--draft-model", str(other), "--prompt", "hi")
    assert_one_line_error(result, "vocabulary")


def test_a_draft_that_never_pays_is_paused_and_probed():
    """A draft whose tokens are never accepted stops costing steps: it is probed ever more
    rarely."""
    stats = DecodingStats()
    source = DraftModel(DRAFT, VOCAB, num_draft=4, draft_cost_prior=0.3).source()
    reference = tokens_of([1, 2, 3], TARGET, max_tokens=120)
    assert tokens_of([1, 2, 3], TARGET, [source], max_tokens=120, stats=stats) == reference
    drafts = stats.source("draft_model").drafts
    assert stats.draft_accepted <= 0.1 * stats.draft_proposed  # the random draft rarely agrees
    assert drafts < 30 and stats.target_forward_passes > 90


@pytest.mark.slow
def test_self_draft_pair_from_the_command_line(embedded, tmp_path):
    """The README's offline pair: the embedded model and its first layers (convert.py
    --num-layers)."""
    from loading.conversion import convert
    from loading.load import embedded_gguf

    _, _, target = embedded
    draft = convert(str(tmp_path / "draft"), gguf=str(embedded_gguf()), num_layers=6)
    args = [
        "--model",
        str(target),
        "--prompt",
        "List three fruits.",
        "--max-tokens",
        "24",
        "--json",
    ]
    plain = json.loads(cli(*args).stdout)
    result = cli(*args[:-1], "--draft-model", str(draft), "--color", "always", "--verbose")
    assert result.returncode == 0, result.stderr
    assert "draft_model" in result.stdout  # the legend and the per-source line
    # the coloured text is the plain run's, and the draft model proposed tokens
    shown = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout)
    assert shown.startswith(plain["text"]), shown
    assert re.search(r"draft_model: proposed [1-9]", shown), shown


@pytest.mark.parametrize("shared", [3, 40])
def test_a_reused_source_with_a_sliding_draft_goes_back_or_starts_over_losslessly(
    shared, monkeypatch
):
    """A source kept across generations keeps its cache row and goes back to what the new prompt
    shares with the old text; where its sliding layers dropped those positions (a short shared
    prefix, drops every few tokens here) the row is prefilled again. Either way: plain's tokens."""
    from decoder.cache import KVRows
    from tests.architectures import VOCAB as ARCH_VOCAB
    from tests.architectures import build

    monkeypatch.setattr(KVRows, "window_step", 4)
    model, _ = build("gemma3_text")
    first = [(5 * i) % 60 + 3 for i in range(50)]
    second = first[:shared] + [7, 9, 11, 13]
    source = DraftModel(model, ARCH_VOCAB, num_draft=3, adaptive=False).source()
    tokens_of(first, model, [source], max_tokens=20)
    got = tokens_of(second, model, [source], max_tokens=20)
    assert got == tokens_of(second, model, max_tokens=20)
    assert len(source.drafter.rows) == 1 and source.drafter.cache.rows == 1
