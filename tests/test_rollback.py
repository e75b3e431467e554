"""rollback.py: every rollback is checked, sliding windows trim at any length, recurrent layers go
back to their checkpoint, and a run of rejections cannot grow the re-feed without bound."""

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache, RotatingKVCache, _BaseCache

import decoder
from decoder import DecodingStats, generate_step
from rollback import CacheKindError, Rollback, SlidingKVCache, convert, make_cache
from tests.architectures import build
from tests.helpers import ScriptedSource, tiny_llama


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 12)), min_size=1, max_size=30),
       window=st.integers(1, 9), seed=st.integers(0, 100))
def test_a_sliding_cache_sees_what_a_full_cache_sees_through_the_window_after_any_trims(steps, window, seed):
    """Steps of n new tokens, then a trim of up to n (a rejected draft): each query sees the same keys,
    masked to its window, as with every key kept (KVCache with the windowed causal mask)."""
    mx.random.seed(seed)
    SlidingKVCache.step, saved = 16, SlidingKVCache.step  # small blocks: drops happen within the test
    try:
        sliding, full = SlidingKVCache(window), KVCache()
        for new, trim in steps:
            keys = mx.random.normal((1, 1, new, 4))
            outputs = []
            for cache in (sliding, full):
                mask = cache.make_mask(new, window_size=window, return_array=True)
                got_keys, got_values = cache.update_and_fetch(keys, keys)
                outputs.append(mx.fast.scaled_dot_product_attention(keys, got_keys, got_values, scale=1.0,
                                                                    mask=mask))
            assert mx.allclose(outputs[0], outputs[1], atol=1e-5)
            trim = min(trim, new)
            assert sliding.trim(trim) == full.trim(trim) == trim
    finally:
        SlidingKVCache.step = saved


def test_a_rollback_that_does_less_raises_never_passes_silently():
    cache = [SlidingKVCache(4)]
    cache[0].update_and_fetch(mx.zeros((1, 1, 300, 4)), mx.zeros((1, 1, 300, 4)))
    rollback = Rollback(cache)
    with pytest.raises(RuntimeError, match="could not drop its last 300 tokens"):
        rollback.rewind(300, 301)  # further back than the slack it keeps


def test_kinds_that_cannot_be_rolled_back_are_refused_in_one_line():
    class Opaque(_BaseCache):  # a model's own cache kind, neither trimmable nor a recurrent state
        pass

    with pytest.raises(CacheKindError, match="its Opaque layers can neither be trimmed nor restored"):
        Rollback([KVCache(), Opaque()])
    full = RotatingKVCache(max_size=4)
    full.update_and_fetch(mx.zeros((1, 1, 6, 4)), mx.zeros((1, 1, 6, 4)))
    with pytest.raises(CacheKindError, match="cannot be rolled back once full"):
        Rollback([full])  # mlx-lm's own, given as a prompt cache
    with pytest.raises(CacheKindError, match="already holds tokens"):
        convert(full)
    with pytest.raises(CacheKindError, match="always keeps its first 4 tokens"):
        convert(RotatingKVCache(max_size=8, keep=4))
    model = tiny_llama()
    model.make_cache = lambda: [Opaque() for _ in model.layers]
    with pytest.raises(CacheKindError, match="^llama: its Opaque layers"):
        list(generate_step([1, 2], model, eos_token_ids=(), max_tokens=2))


def test_rejections_on_a_recurrent_model_feed_again_but_never_more_than_max_pending(monkeypatch):
    """A source whose drafts are always rejected after their first token: each rejection sends the
    recurrent layers back to their checkpoint, so the pass's tokens wait to be fed again; past
    MAX_PENDING the row drafts nothing until they are in. The text is plain decoding's throughout."""
    model, _ = build("qwen3_next")
    prompt = [3, 14, 15, 92, 65]
    plain = [token for token, _ in generate_step(prompt, model, eos_token_ids=(), max_tokens=40)]
    widths = []
    forward = type(model).__call__

    def recorded(self, inputs, cache=None):
        widths.append(inputs.shape[1])
        return forward(self, inputs, cache=cache)

    monkeypatch.setattr(type(model), "__call__", recorded)
    monkeypatch.setattr(decoder, "MAX_PENDING", 6)

    def right_then_wrong(tokens, max_draft):
        position = len(tokens) - len(prompt)
        return ([plain[position], (plain[position + 1] + 1) % 1000] if position + 2 < len(plain) else [])

    stats = DecodingStats()
    got = [token for token, _ in generate_step(prompt, model, eos_token_ids=(), max_tokens=40, stats=stats,
                                               draft_sources=[ScriptedSource(right_then_wrong)])]
    assert got == plain
    assert 0 < stats.draft_accepted < stats.draft_proposed
    passes = widths[1:]  # after the prefill
    assert max(passes) <= 6 + 3  # pending, capped, plus a draft of two
    assert any(width > 3 for width in passes)  # tokens were fed again


def test_make_cache_keeps_attention_and_recurrent_layers_and_makes_sliding_ones_trimmable():
    for name, kinds in (("gemma3_text", {"SlidingKVCache", "KVCache"}), ("qwen3_next", {"ArraysCache", "KVCache"})):
        model, _ = build(name)
        assert {type(layer).__name__ for layer in make_cache(model)} == kinds
