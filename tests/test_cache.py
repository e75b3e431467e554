"""cache/: one cache layer for 1 to B rows. Every row attends as a cache that never drops anything
would let it, through passes, per-row rollbacks, rows leaving and joining, realignment and a row's
prefix taken out and put back; every rollback is checked; recurrent layers go back to their
checkpoint, and a run of rejections cannot grow the re-feed without bound."""

import random

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import ChunkedKVCache, KVCache, RotatingKVCache, _BaseCache

from decoder import DecodingStats, generate_step
from decoder.cache import CacheKindError, KVRows, adopt, make_cache
from tests.architectures import build
from tests.helpers import ScriptedSource, tiny_llama

DIM = 4


def reference(keys: list, queries: np.ndarray, window) -> np.ndarray:
    """Attention of the last len(queries) positions over every key of one row (nothing dropped)."""
    keys = np.stack(keys)
    outputs = []
    for index, query in enumerate(queries):
        position = len(keys) - len(queries) + index
        first = 0 if window is None else max(0, position - window + 1)
        seen = keys[first : position + 1]
        scores = seen @ query
        weights = np.exp(scores - scores.max())
        outputs.append(weights @ seen / weights.sum())
    return np.stack(outputs)


def attend(layer: KVRows, new: mx.array, window) -> np.ndarray:
    mask = layer.make_mask(new.shape[2], window_size=window)
    keys, values = layer.update_and_fetch(new, new)
    return np.array(mx.fast.scaled_dot_product_attention(new, keys, values, scale=1.0, mask=mask))


def pass_of(layer: KVRows, rows: list, width: int, window, rng: random.Random, trim: bool = True):
    """Every row writes ``width`` keys and must see what it would with nothing dropped; then each
    drops a tail of its own, as far back as ``can_trim`` says it may (across calls too)."""
    new = mx.array(
        np.random.default_rng(rng.randrange(2**31)).normal(size=(len(rows), 1, width, DIM)),
        mx.float32,
    )
    got = attend(layer, new, window)
    for row, history in enumerate(rows):
        history += list(np.array(new[row, 0]))
        assert np.allclose(
            got[row, 0], reference(history, np.array(new[row, 0]), window), atol=1e-4
        )
    trims = [
        rng.randrange(layer.can_trim(row) + 1) if trim and rng.random() < 0.5 else 0
        for row in range(len(rows))
    ]
    layer.trim_rows(trims)
    for history, trim in zip(rows, trims):
        del history[len(history) - trim :]


def small(rows: int, window) -> KVRows:
    """Small blocks and slack, so that sliding rows drop old slots within a test."""
    layer = KVRows(rows, window, max_rollback=3)
    layer.step, layer.window_step = 8, 4
    return layer


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.sampled_from(["pass", "pass", "pass", "leave", "join", "realign", "move"]),
        min_size=1,
        max_size=30,
    ),
    window=st.one_of(st.none(), st.integers(1, 9)),
    rows=st.integers(1, 3),
    seed=st.integers(0, 10**6),
)
def test_every_row_attends_as_a_cache_that_never_drops_anything(ops, window, rows, seed):
    rng = random.Random(seed)
    layer, histories = small(rows, window), [[] for _ in range(rows)]
    for op in ops + ["pass"]:
        if op == "pass" or not histories[0]:
            pass_of(layer, histories, rng.randrange(1, 12), window, rng)
        elif op == "leave" and len(histories) > 1:
            keep = rng.sample(range(len(histories)), rng.randrange(1, len(histories)))
            layer.filter(keep)
            histories = [histories[i] for i in keep]
        elif op == "join":
            joining, history = small(1, window), [[]]
            for _ in range(rng.randrange(1, 4)):
                pass_of(joining, history, rng.randrange(1, 12), window, rng)
            if history[0]:
                layer.extend(joining)
                histories += history
        elif op == "realign":
            layer.realign()
        # a row's prefix out and back in, at the end (a prompt cache)
        elif op == "move" and any(histories):
            row = rng.choice([i for i, history in enumerate(histories) if history])
            keys, values, first = layer.extract(row)
            # a window of 1 needs no earlier key: a row may keep none
            kept = np.array(histories[row][first:]).reshape(-1, DIM)
            assert np.allclose(np.array(keys[0, 0]), kept)
            alone = small(1, window)
            alone.fill(0, keys, values, first)
            if len(histories) > 1:
                layer.filter([i for i in range(len(histories)) if i != row])
                layer.extend(alone)
            else:
                layer = alone
            histories.append(histories.pop(row))
    if window is not None:  # lean: once aligned, each row keeps its window and the slack, in blocks
        layer.realign()
        # fills the buffer: the next one holds only what rows need
        for _ in range(layer.keys.shape[2] + 1):
            pass_of(layer, histories, 1, window, rng, trim=False)
        assert layer.keys.shape[2] <= window + layer.max_rollback + layer.window_step


def test_a_rollback_further_than_a_row_can_go_raises_never_passes_silently():
    layer = KVRows(2, window=4, max_rollback=2)
    for _ in range(100):  # one token at a time: the old slots are dropped
        layer.update_and_fetch(mx.zeros((2, 1, 1, DIM)), mx.zeros((2, 1, 1, DIM)))
    assert 2 <= layer.can_trim(0) < 100  # its slack, at least, and not what was dropped
    with pytest.raises(RuntimeError, match="cannot drop its last"):
        layer.trim_rows([0, layer.can_trim(1) + 1])
    can = min(layer.can_trim(0), layer.can_trim(1))
    assert layer.trim(100) == can  # mlx-lm's trim: as much as every row can, and says so


def test_kinds_that_cannot_be_rolled_back_are_refused_in_one_line():
    class Opaque(_BaseCache):  # a model's own cache kind
        pass

    model = tiny_llama()
    model.make_cache = lambda: [Opaque() for _ in model.layers]
    with pytest.raises(CacheKindError, match="^llama: its Opaque layers cannot be rolled back"):
        list(generate_step([1, 2], model, eos_token_ids=(), max_tokens=2))
    model.make_cache = lambda: [RotatingKVCache(max_size=8, keep=4) for _ in model.layers]
    with pytest.raises(CacheKindError, match="always keeps its first 4 tokens"):
        make_cache(model)
    model.make_cache = lambda: [ChunkedKVCache(8) for _ in model.layers]
    assert make_cache(model).rows == 1
    with pytest.raises(CacheKindError, match="^llama: its ChunkedKVCache layers cannot be batched"):
        make_cache(model, rows=2)
    full = RotatingKVCache(max_size=4)
    full.update_and_fetch(mx.zeros((1, 1, 6, 4)), mx.zeros((1, 1, 6, 4)))
    with pytest.raises(CacheKindError, match="already holds tokens"):
        adopt([KVCache(), full])  # mlx-lm's own, given as a prompt cache


def test_rejections_on_a_recurrent_model_feed_again_but_never_more_than_max_pending(monkeypatch):
    """A source whose drafts are always rejected after their first token: each rejection sends the
    recurrent layers back to their checkpoint, so the pass's tokens wait to be fed again; past
    MAX_PENDING the row drafts nothing until they are in. The text is plain decoding's
    throughout."""
    model, _ = build("qwen3_next")
    prompt = [3, 14, 15, 92, 65]
    plain = [token for token, _ in generate_step(prompt, model, eos_token_ids=(), max_tokens=40)]
    widths = []
    forward = type(model).__call__

    def recorded(self, inputs, cache=None):
        widths.append(inputs.shape[1])
        return forward(self, inputs, cache=cache)

    monkeypatch.setattr(type(model), "__call__", recorded)
    monkeypatch.setattr("decoder.row.MAX_PENDING", 6)

    def right_then_wrong(tokens, max_draft):
        position = len(tokens) - len(prompt)
        return (
            [plain[position], (plain[position + 1] + 1) % 1000] if position + 2 < len(plain) else []
        )

    stats = DecodingStats()
    got = [
        token
        for token, _ in generate_step(
            prompt,
            model,
            eos_token_ids=(),
            max_tokens=40,
            stats=stats,
            draft_sources=[ScriptedSource(right_then_wrong)],
        )
    ]
    assert got == plain
    assert 0 < stats.draft_accepted < stats.draft_proposed
    passes = widths[1:]  # after the prefill
    assert max(passes) <= 6 + 3  # pending, capped, plus a draft of two
    assert any(width > 3 for width in passes)  # tokens were fed again


def test_make_cache_has_one_kind_per_kind_of_layer():
    for name, kinds in (
        ("gemma3_text", {(4, "KVRows"), (None, "KVRows")}),
        ("qwen3_next", {(None, "StateRows"), (None, "KVRows")}),
    ):
        model, config = build(name)
        got = {
            (getattr(layer, "window", None), type(layer).__name__)
            for layer in make_cache(model).layers
        }
        assert got == {(config.get("sliding_window") if w else None, kind) for w, kind in kinds}
