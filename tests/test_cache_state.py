"""A cache saved with mlx-lm's ``save_prompt_cache`` and read back with ``load_cache`` holds the
same tokens, row by row, for every kind of layer, and decoding goes on from it as from the cache
that was saved."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import CacheList, load_prompt_cache, save_prompt_cache

from decoder import generate_step, load_cache, make_cache
from decoder.cache import layers_of
from decoder.layer_caches import KVRows, StateRows
from decoder.prefill import Prefill
from tests.architectures import WINDOW, build

# longer than a sliding layer's window plus its rollback slack, so it has dropped slots
PROMPT = [(7 * index + 3) % 500 for index in range(150)]
CACHED = 120  # the prompt's first tokens in the saved cache


def round_trip(cache, tmp_path):
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache.layers)
    return load_cache(path)


def assert_same_layers(loaded, original):
    """Every layer of the same kind, holding the same rows and the same arrays for them."""
    assert loaded.rows == original.rows
    assert [type(layer) for layer in loaded.layers] == [type(layer) for layer in original.layers]
    for got, want in zip(layers_of(loaded.layers), layers_of(original.layers)):
        if isinstance(want, KVRows):
            assert (got.starts, got.ends, got.origins) == (want.starts, want.ends, want.origins)
            assert (got.window, got.max_rollback, got.mask_dims) == (
                want.window,
                want.max_rollback,
                want.mask_dims,
            )
            top = max(want.ends)
            assert mx.array_equal(got.keys, want.keys[..., :top, :])
            assert mx.array_equal(got.values, want.values[..., :top, :])
        elif isinstance(want, StateRows):
            assert got.rows == want.rows and got.saved is None
            assert all(mx.array_equal(a, b) for a, b in zip(got.cache, want.cache))
        else:  # ChunkedRows
            assert (got.offset, got.start_position, got.chunk_size) == (
                want.offset,
                want.start_position,
                want.chunk_size,
            )
            assert mx.array_equal(got.keys, want.keys)


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_next", "llama4", "falcon_h1"])
def test_a_saved_cache_decodes_on_as_the_cache_it_was(name, tmp_path):
    """Full attention, sliding windows, recurrent layers beside attention, attention in chunks
    and a ``CacheList`` of both per layer: the loaded cache continues the prompt token for token
    as the original does, and as decoding the whole prompt without a cache does."""
    model, _ = build(name)
    cache = make_cache(model)
    Prefill(model, [PROMPT[:CACHED]], step_size=32, cache=cache).run()
    loaded = round_trip(cache, tmp_path)
    assert_same_layers(loaded, cache)
    assert loaded.held() == cache.held() == CACHED
    if name == "gemma3_text":  # the case of a sliding row that dropped its oldest slots
        sliding = [layer for layer in loaded.layers if layer.window == WINDOW]
        assert sliding and all(layer.origins[0] < 0 for layer in sliding)

    def decode(prompt_cache):
        steps = generate_step(
            PROMPT, model, eos_token_ids=(), max_tokens=12, prompt_cache=prompt_cache
        )
        return [token for token, _ in steps]

    from_loaded = decode(loaded)
    assert from_loaded == decode(cache) == decode(None)


def test_a_recurrent_model_saves_its_states(tmp_path):
    """Layers of states only (no count of tokens to continue a prompt from): the next token's
    logits from the loaded cache are the original's."""
    model, _ = build("mamba")
    cache = make_cache(model)
    Prefill(model, [PROMPT[:CACHED]], cache=cache).run()
    loaded = round_trip(cache, tmp_path)
    assert_same_layers(loaded, cache)
    token = mx.array([[PROMPT[CACHED]]])
    assert mx.array_equal(model(token, cache=loaded.layers), model(token, cache=cache.layers))


@pytest.mark.parametrize("name", ["llama", "gemma3_text"])
def test_rows_of_different_lengths_keep_their_own_ends(name, tmp_path):
    """Two rows, one shorter: each keeps its own start, end and origin, so each row's next token
    sees what it did before the cache was saved."""
    model, _ = build(name)
    cache = make_cache(model, rows=2)
    Prefill(model, [PROMPT[:CACHED], PROMPT[:50]], step_size=32, cache=cache).run()
    cache.rewind(trims=[0, 7])  # the second row drops a tail: ends differ
    loaded = round_trip(cache, tmp_path)
    assert_same_layers(loaded, cache)
    assert [loaded.held(row) for row in range(2)] == [CACHED, 43]
    tokens = mx.array([[PROMPT[CACHED]], [PROMPT[43]]])
    got = model(tokens, cache=loaded.layers)
    want = model(tokens, cache=cache.layers)
    assert np.allclose(np.array(got), np.array(want), atol=1e-5)


def test_mlx_lm_loader_cannot_find_these_kinds_so_load_cache_exists(tmp_path):
    """mlx-lm looks each saved class up among its own; the file is still the same format, which
    ``load_cache`` reads with the kinds here added (CacheList children included)."""
    model, _ = build("falcon_h1")
    cache = make_cache(model)
    Prefill(model, [PROMPT[:20]], cache=cache).run()
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache.layers)
    with pytest.raises(KeyError):
        load_prompt_cache(path)
    assert all(isinstance(layer, CacheList) for layer in load_cache(path).layers)
