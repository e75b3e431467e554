"""Every feature on tiny random models of mlx-lm's architectures, past their sliding windows.

One model per kind of cache the engine must handle (issue #36): full attention (KVCache), with
experts and latent attention; sliding windows (RotatingKVCache beside KVCache); attention chunks
(ChunkedKVCache); recurrent layers (ArraysCache) beside attention, in CacheLists and alone. Each
is checked against mlx-lm's own greedy tokens (tests/architecture_checks.py). Many of these fail
on an engine that cannot roll back a full window or a recurrent state: they are meant to.
``python -m benchmarks.compatibility`` runs the same checks on every model of
tests/architectures.py and writes docs/compatibility.md.
"""

import pytest

from decoder.cache import CacheKindError, KVRows
from tests import architecture_checks as checks
from tests.architectures import build, save, tokenizer

# recurrent layers beside attention, beside sliding windows, in CacheLists, alone
RECURRENT = [
    "qwen3_next",
    "qwen3_5",
    "lfm2",
    "nemotron_h",
    "falcon_h1",
    "recurrent_gemma",
    "baichuan_m1",
    "mamba2",
]
TESTED = [
    # full attention, with experts, with latent attention (deepseek_v32 in CacheLists); mistral3
    # scales attention by position
    "llama",
    "qwen3",
    "qwen3_moe",
    "deepseek_v3",
    "deepseek_v32",
    "gemma2",
    "mistral3",
    # sliding windows, gemma4_text with layers sharing their KV caches
    "gemma3_text",
    "gemma4_text",
    "gpt_oss",
    "cohere2",
    "exaone4",
    # attention chunks
    "llama4",
    *RECURRENT,
]
# What drafts chains under --tree-nodes: recurrent and chunked layers, and mistral3, which builds
# per-position attention scales from the offset itself.
CHAINS_ONLY = {"mistral3", "llama4", *RECURRENT}
THROUGH_MAIN = ["llama", "mistral3", "gemma3_text", "qwen3_next"]
# What a batch cannot hold, and the one line that says so: llama4 builds its chunk mask from one
# scalar offset, so its rows cannot keep their own lengths.
REFUSED_IN_A_BATCH = {"llama4": "llama4: its ChunkedKVCache layers cannot be batched"}


@pytest.fixture(autouse=True)
def lean_windows(monkeypatch):
    """Sliding rows drop old slots every few tokens, with little slack: drops happen within these
    short texts, before and after drafts, in every row of a batch."""
    monkeypatch.setattr(KVRows, "window_step", 4)
    monkeypatch.setattr(KVRows, "max_rollback", 5)


@pytest.fixture(scope="module", params=TESTED)
def tiny(request):
    """``(model, config)`` of one architecture, built once for all its tests."""
    return build(request.param)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return tokenizer()


def test_plain_greedy_equals_mlx_lm(tiny):
    checks.check_plain(tiny[0])


def test_prompt_lookup_is_lossless_past_the_window(tiny):
    checks.check_prompt_lookup(tiny[0])


def test_regex_with_forced_text_and_lookup_equals_the_constraint_alone(tiny, smollm2_tokenizer):
    checks.check_regex(tiny[0], smollm2_tokenizer)


@pytest.mark.parametrize("lookup", [False, True], ids=["plain", "lookup"])
def test_batch_rows_of_different_lengths_equal_each_alone(tiny, lookup):
    refusal = REFUSED_IN_A_BATCH.get(tiny[1]["model_type"])
    if refusal is None:
        checks.check_batch(tiny[0], lookup=lookup)
    else:
        with pytest.raises(CacheKindError, match=refusal):
            checks.check_batch(tiny[0], lookup=lookup)


def test_draft_trees_equal_mlx_lm_or_fall_back_to_chains(tiny):
    """Every attention model verifies trees; a model with recurrent layers, attention chunks or
    positions of its own (mistral3 scales attention by position) drafts chains, losslessly."""
    batch = tiny[1]["model_type"] not in REFUSED_IN_A_BATCH
    trees = checks.check_trees(tiny[0], batch=batch)
    if tiny[1]["model_type"] in CHAINS_ONLY:
        assert trees == 0
    else:
        assert trees > 0, "no tree was drafted"


def test_quantized_is_lossless(tiny):
    # 4 bits: the coarser grid, where a near-tie is likelier to flip (8 bits: conversion tests)
    checks.check_quantized(*tiny, bits=4)


@pytest.mark.slow
@pytest.mark.parametrize("name", THROUGH_MAIN)
def test_main_runs_a_saved_model_directory(name, tmp_path, smollm2_tokenizer):
    model, config = build(name)
    checks.check_main(model, save(tmp_path / name, model, config), smollm2_tokenizer)


def test_a_draft_model_with_recurrent_layers_is_refused_naming_its_architecture():
    """Draft models roll back by trimming, which a recurrent state cannot: refused (one class for
    one row and a batch) in one line that names the draft's architecture."""
    from draft_model import DraftModel

    draft, _ = build("qwen3_next")
    refusal = "^qwen3_next: a draft model with recurrent layers cannot "
    with pytest.raises(CacheKindError, match=refusal + "roll back its drafts$"):
        DraftModel(draft, vocab_size=49152)
