"""T5 in MLX against transformers (the oracle), plus cache and loader checks."""

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from t5 import (
    ModelArgs,
    T5Decoder,
    convert_t5,
    is_encoder_decoder,
    is_t5_dir,
    load_t5,
    load_t5_model,
)
from t5.t5 import relative_position_bucket
from tests.helpers import tiny_llama
from tests.t5_fixtures import VOCAB_SIZE, make_tiny_t5_dir, train_tiny_spiece

# (variant, encoder layers, decoder layers)
VARIANTS = [("v1.0", 2, None), ("v1.1", 2, None), ("v1.1", 2, 3)]
# Longer than relative_attention_max_distance=20, so every bucket kind is used.
SOURCE_LENGTH, TARGET_LENGTH = 25, 24


@pytest.fixture(scope="module")
def spiece(tmp_path_factory):
    return train_tiny_spiece(tmp_path_factory.mktemp("spiece") / "spiece.model")


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: f"{v[0]}-dec{v[2] or v[1]}")
def t5_dir(request, tmp_path_factory, spiece):
    variant, num_layers, num_decoder_layers = request.param
    path = tmp_path_factory.mktemp(variant)
    return make_tiny_t5_dir(path, variant, 0, num_layers, num_decoder_layers, spiece_model=spiece)


def random_ids(length, seed, batch=1):
    return mx.array(np.random.default_rng(seed).integers(2, VOCAB_SIZE, (batch, length)))


def target_ids(length, seed=1):
    # Decoder inputs start with decoder_start_token_id (0), as in generation.
    ids = random_ids(length, seed)
    return mx.concatenate([mx.zeros((1, 1), ids.dtype), ids[:, 1:]], axis=1)


def hf_model(path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.T5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return model.eval(), torch


def test_model_args():
    config = {"d_model": 16, "num_layers": 3, "architectures": ["T5"], "dense_act_fn": "relu"}
    args = ModelArgs.from_dict(config)
    assert (args.d_model, args.num_decoder_layers, args.scale_decoder_outputs) == (16, 3, True)
    with pytest.raises(ValueError, match="unsupported feed_forward_proj"):
        ModelArgs(feed_forward_proj="gated-tanh")


def test_relative_position_bucket_matches_transformers():
    torch = pytest.importorskip("torch")
    from transformers.models.t5.modeling_t5 import T5Attention

    relative = np.arange(-200, 201)[None]
    for bidirectional in [True, False]:
        for num_buckets, max_distance in [(8, 20), (32, 128)]:
            expected = T5Attention._relative_position_bucket(
                torch.tensor(relative), bidirectional, num_buckets, max_distance
            )
            ours = relative_position_bucket(
                mx.array(relative), bidirectional, num_buckets, max_distance
            )
            np.testing.assert_array_equal(np.array(ours), expected.numpy())


def test_matches_transformers(t5_dir, tmp_path):
    model = load_t5_model(t5_dir)
    hf, torch = hf_model(t5_dir)
    source = random_ids(SOURCE_LENGTH, seed=0, batch=2)
    target = mx.concatenate([target_ids(TARGET_LENGTH, seed=1), target_ids(TARGET_LENGTH, seed=2)])

    encoder_output = model.encode(source)
    logits = model.decode(target, model.cross_attention_memory(encoder_output))
    with torch.no_grad():
        out = hf(
            input_ids=torch.tensor(np.array(source)),
            decoder_input_ids=torch.tensor(np.array(target)),
            use_cache=False,
        )
    np.testing.assert_allclose(
        np.array(encoder_output), out.encoder_last_hidden_state.numpy(), atol=1e-4
    )
    np.testing.assert_allclose(np.array(logits), out.logits.numpy(), atol=1e-4)

    # transformers 5 re-saves every T5 with tie_word_embeddings=true and
    # scale_decoder_outputs; the loader must still pick the right head.
    hf.save_pretrained(tmp_path)
    resaved = load_t5_model(tmp_path)
    assert resaved.args.tie_word_embeddings == model.args.tie_word_embeddings
    logits_resaved = resaved.decode(target, resaved.cross_attention_memory(resaved.encode(source)))
    np.testing.assert_allclose(np.array(logits_resaved), np.array(logits), atol=1e-5)


def full_and_memory(model):
    memory = model.cross_attention_memory(model.encode(random_ids(SOURCE_LENGTH, seed=0)))
    target = target_ids(TARGET_LENGTH)
    return target, memory, model.decode(target, memory)


def test_token_by_token_matches_full_pass(t5_dir):
    model = load_t5_model(t5_dir)
    target, memory, full = full_and_memory(model)
    cache = model.make_cache()
    steps = [model.decode(target[:, t : t + 1], memory, cache) for t in range(TARGET_LENGTH)]
    np.testing.assert_allclose(np.array(mx.concatenate(steps, axis=1)), np.array(full), atol=1e-5)
    assert cache[0].offset == TARGET_LENGTH


def test_block_after_trim_matches_full_pass(t5_dir):
    model = load_t5_model(t5_dir)
    target, memory, full = full_and_memory(model)
    cache = model.make_cache()
    assert can_trim_prompt_cache(cache)

    # Verify 6 tokens, reject the last 2, then verify a block of 4 again.
    model.decode(target[:, :6], memory, cache)
    assert trim_prompt_cache(cache, 2) == 2
    block = model.decode(target[:, 4:8], memory, cache)
    np.testing.assert_allclose(np.array(block), np.array(full[:, 4:8]), atol=1e-5)
    # Past the log-spaced buckets and max_distance, blocks stay exact.
    model.decode(target[:, 8:17], memory, cache)
    trim_prompt_cache(cache, 3)
    block = model.decode(target[:, 14:], memory, cache)
    np.testing.assert_allclose(np.array(block), np.array(full[:, 14:]), atol=1e-5)


def test_t5_decoder_adapter(t5_dir):
    model = load_t5_model(t5_dir)
    source = random_ids(SOURCE_LENGTH, seed=0)
    target, _, full = full_and_memory(model)
    decoder = T5Decoder(model, source[0].tolist())
    assert decoder.prompt_tokens() == [0]
    # The one test for "a T5": the adapter already looks decoder-only, and so does an mlx-lm model.
    assert is_encoder_decoder(model) and not is_encoder_decoder(decoder)
    assert not is_encoder_decoder(tiny_llama(vocab_size=VOCAB_SIZE, num_layers=1))
    assert decoder.args is model.args

    cache = decoder.make_cache()
    assert len(cache) == model.args.num_decoder_layers and can_trim_prompt_cache(cache)
    first = decoder(target[:, :10], cache)
    trim_prompt_cache(cache, 5)
    rest = decoder(target[:, 5:], cache)
    np.testing.assert_allclose(np.array(first), np.array(full[:, :10]), atol=1e-5)
    np.testing.assert_allclose(np.array(rest), np.array(full[:, 5:]), atol=1e-5)
    # The encoder memory is untouched by trimming the decoder cache.
    assert decoder.memory[0][0].shape[2] == SOURCE_LENGTH


def test_tokenizer_round_trip(t5_dir):
    _, tokenizer = load_t5(t5_dir)
    text = "the quick brown dog jumps over the lazy cat."
    ids = tokenizer.encode(text)
    assert ids[-1] == tokenizer.eos_token_id == 1 and tokenizer.eos_token_ids == {1}
    assert tokenizer.vocab_size == VOCAB_SIZE and max(ids) < VOCAB_SIZE
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([0] + ids) == text


def test_convert_round_trip(t5_dir, tmp_path):
    model = load_t5_model(t5_dir)
    target, _, full = full_and_memory(model)

    convert_t5(t5_dir, tmp_path / "f32", dtype="float32")
    converted, tokenizer = load_t5(tmp_path / "f32")
    assert tokenizer is not None and is_t5_dir(tmp_path / "f32")
    _, _, converted_full = full_and_memory(converted)
    np.testing.assert_array_equal(np.array(converted_full), np.array(full))

    convert_t5(t5_dir, tmp_path / "bf16")
    bf16 = load_t5_model(tmp_path / "bf16")
    assert bf16.shared.weight.dtype == mx.bfloat16
    _, _, bf16_full = full_and_memory(bf16)
    np.testing.assert_allclose(np.array(bf16_full.astype(mx.float32)), np.array(full), atol=0.1)


def test_loader_errors(tmp_path):
    assert not is_t5_dir(tmp_path)
    with pytest.raises(ValueError, match="not a T5 directory"):
        load_t5(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_t5(tmp_path)


def test_the_readme_snippet_runs(t5_dir, capsys):
    # t5/README.md's snippet, on the tiny checkpoint instead of flan-t5-small.
    readme = (Path(__file__).resolve().parent.parent / "t5" / "README.md").read_text()
    code = re.findall(r"^```python\n(.*?)^```", readme, flags=re.S | re.M)[0]
    assert '"flan-t5-small"' in code
    namespace = {}
    exec(code.replace('"flan-t5-small"', repr(str(t5_dir))), namespace)
    result = namespace["result"]
    assert result.stats.target_forward_passes > 0 and capsys.readouterr().out == result.text + "\n"


def test_what_t5_does_not_support_is_refused_in_one_line(t5_dir):
    # Each is decided by is_encoder_decoder, before any draft head download or server start.
    import main
    from cli import CliError
    from server.__main__ import build_engine
    from server.__main__ import build_parser as server_parser

    args = main.build_parser().parse_args(
        ["--model", str(t5_dir), "--prompt", "hi", "--draft-head"]
    )
    main.validate(args)
    with pytest.raises(CliError, match="--draft-head needs a decoder-only model"):
        main.build_run(args)
    args = main.build_parser().parse_args(["--model", str(t5_dir), "--prompt", "hi"])
    main.validate(args)
    with pytest.raises(CliError, match="a T5 target cannot be sharded"):
        main.build_run(args, session=object())  # as under mlx.launch; refused before sharding
    with pytest.raises(CliError, match="the server serves decoder-only models"):
        build_engine(server_parser().parse_args(["--model", str(t5_dir)]))
