"""MTP drafts: the Hugging Face layouts read, the forward checked stage by stage against a
reference, lossless greedy (alone, under a regex, on a hybrid model), exact sampling, >= 90%
acceptance where the MTP layer predicts the target exactly, conversion keeping and quantizing the
weights, refusals."""

import json

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten

from decoder import DecodingStats, generate_step
from loading.target import load_mlx_lm
from mtp.model import (
    MIMO_LAYOUT,
    MTP_CLASSES,
    MTP_FILE,
    QWEN_LAYOUT,
    MTPError,
    NoMTPWeights,
    load_mtp,
    mtp_prefix,
    text_model,
)
from mtp.source import MTPDrafter
from tests.helpers import assert_sampling_keeps_the_target_distribution, tiny_byte_tokenizer
from tests.mtp_fixtures import VOCAB, hf_weights, text_config, write_checkpoint

LAYOUTS = ["deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe", "mimo"]


def load(path):
    """The target of the checkpoint in ``path``, as the loop runs on it: Qwen3.5's language model
    without mlx-lm's vision-language wrapper, whose ``args`` hold no ``vocab_size`` for
    MTPSource."""
    return text_model(load_mlx_lm(path)[0])


def projection(model_type: str) -> str:
    """The name of the MTP layer's 2d -> d projection."""
    return (
        "fc"
        if model_type in QWEN_LAYOUT
        else "input_proj"
        if model_type in MIMO_LAYOUT
        else "eh_proj"
    )


def tokens_of(prompt, model, sources=(), max_tokens=40, stats=None, **options):
    return [
        t
        for t, _ in generate_step(
            prompt,
            model,
            draft_sources=sources,
            eos_token_ids=(),
            max_tokens=max_tokens,
            stats=stats,
            **options,
        )
    ]


@pytest.fixture(scope="module", params=LAYOUTS)
def noisy(request, tmp_path_factory):
    """A checkpoint whose MTP layer is right often, not always (the exact wiring plus noise), and
    the loaded ``(directory, target, built target, built mtp)``."""
    path = tmp_path_factory.mktemp(request.param)
    _, built, mtp = write_checkpoint(
        path, request.param, seed=1, exact=True, noise=0.08, tokenizer=tiny_byte_tokenizer()
    )
    return path, load(path), built, mtp


def same_parameters(a, b) -> bool:
    a, b = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
    return a.keys() == b.keys() and all(mx.allclose(a[k], b[k], atol=1e-6).item() for k in a)


def test_the_hugging_face_layout_is_read(noisy):
    path, target, built, mtp = noisy
    assert same_parameters(target, text_model(built))  # the target loads without its MTP weights
    assert same_parameters(load_mtp(path, target), mtp)
    assert same_parameters(load_mtp(path, load_mlx_lm(path)[0]), mtp)  # given Qwen3.5's wrapper too


def rms_norm(x, weight, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


class Recorder:
    """A decoder layer that keeps its input and output."""

    def __init__(self, layer):
        self.layer, self.seen = layer, []

    def __call__(self, x, mask, cache):
        self.seen.append((x, self.layer(x, mask, cache)))
        return self.seen[-1][1]


def reference_block(path, config):
    """The MTP decoder layer as mlx-lm itself loads a target layer from the same weights: the
    checkpoint again with the MTP layer's weights as a layer of the target, through mlx-lm's own
    loader and sanitize. Qwen3-Next: its only layer, of full attention. Qwen3.5: its layer 1, of
    full attention, after the target's linear layer 0 (whose ``conv1d`` tells mlx-lm to shift the
    norms). DeepSeek/GLM and MiMo: one more layer after the target's."""
    from mlx_lm.utils import load_model

    raw, layers, prefix = (
        mx.load(str(path / "model.safetensors")),
        text_config(config)["num_hidden_layers"],
        mtp_prefix(config),
    )
    block = {k[len(prefix) :]: v for k, v in raw.items() if k.startswith(prefix)}
    if config["model_type"] == "qwen3_next":
        weights = {k: v for k, v in raw.items() if not k.startswith(("mtp.", "model.layers."))}
        weights.update(
            {
                f"model.layers.0.{k.removeprefix('layers.0.')}": v
                for k, v in block.items()
                if k.startswith("layers.0.")
            }
        )
        config = {**config, "num_hidden_layers": 1, "full_attention_interval": 1}
    elif config["model_type"] in QWEN_LAYOUT:
        weights = {
            k: v
            for k, v in raw.items()
            if not k.startswith(("mtp.", "model.language_model.layers.1."))
        }
        weights.update(
            {
                f"model.language_model.layers.1.{k.removeprefix('layers.0.')}": v
                for k, v in block.items()
                if k.startswith("layers.0.")
            }
        )
    else:
        own = tuple(
            f"{name}." for name in MTP_CLASSES[config["model_type"]].own_weights + ("embed_tokens",)
        )
        weights = {k: v for k, v in raw.items() if not k.startswith(prefix)}
        weights.update(
            {f"model.layers.{layers}.{k}": v for k, v in block.items() if not k.startswith(own)}
        )
        config = {**config, "num_hidden_layers": layers + 1}
    directory = path.parent / f"{path.name}-reference"
    directory.mkdir(exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    (directory / "config.json").write_text(json.dumps(config))
    model, _ = load_model(directory)
    return model.layers[-1]


def expected_fuse(
    raw: dict, config: dict, embeddings: np.ndarray, features: np.ndarray
) -> np.ndarray:
    """Stage 1 by hand: both inputs normalised, concatenated in the layout's order, projected 2d ->
    d."""
    prefix, model_type = mtp_prefix(config), config["model_type"]
    if model_type in QWEN_LAYOUT:  # norms stored zero-centred: the scale is 1 + weight
        e = rms_norm(embeddings, 1 + raw[prefix + "pre_fc_norm_embedding.weight"])
        h = rms_norm(features, 1 + raw[prefix + "pre_fc_norm_hidden.weight"])
        return np.concatenate([e, h], -1) @ raw[prefix + "fc.weight"].T
    embeddings = embeddings.copy()
    embeddings[0] = 0.0  # no token precedes position 0 (vLLM's deepseek_mtp.py and mimo_mtp.py)
    if model_type in MIMO_LAYOUT:  # the hidden state first
        e = rms_norm(embeddings, raw[prefix + "token_layernorm.weight"])
        h = rms_norm(features, raw[prefix + "hidden_layernorm.weight"])
        return np.concatenate([h, e], -1) @ raw[prefix + "input_proj.weight"].T
    e, h = (
        rms_norm(embeddings, raw[prefix + "enorm.weight"]),
        rms_norm(features, raw[prefix + "hnorm.weight"]),
    )
    return np.concatenate([e, h], -1) @ raw[prefix + "eh_proj.weight"].T


def expected_scores(raw: dict, config: dict, block_output: np.ndarray) -> tuple:
    """Stage 3 by hand: ``(what the next chained step reads, logits)``. DeepSeek: the layer's
    output, scored by its own shared_head (norm, head). Qwen and MiMo: the output after their final
    norm, scored by the target's LM head."""
    prefix, model_type = mtp_prefix(config), config["model_type"]
    if model_type in QWEN_LAYOUT:
        normed = rms_norm(block_output, 1 + raw[prefix + "norm.weight"])
    elif model_type in MIMO_LAYOUT:
        normed = rms_norm(block_output, raw[prefix + "final_layernorm.weight"])
    else:
        normed = rms_norm(block_output, raw[prefix + "shared_head.norm.weight"])
        return block_output, normed @ raw[prefix + "shared_head.head.weight"].T
    return normed, normed @ raw["lm_head.weight"].T


def test_the_forward_matches_a_reference_stage_by_stage(noisy):
    path, target, _, _ = noisy
    config = json.loads((path / "config.json").read_text())
    raw = {k: np.array(v) for k, v in mx.load(str(path / "model.safetensors")).items()}
    mtp = load_mtp(path, target)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    hidden = target.model(mx.array([tokens]))  # after the final norm: what the tap hands over
    embeddings = target.model.embed_tokens(mx.array([tokens[1:]]))
    features = hidden[:, :-1]
    if config["model_type"] in QWEN_LAYOUT:
        mtp.layers[0] = recorder = Recorder(mtp.layers[0])
    else:
        mtp.block = recorder = Recorder(mtp.block)
    predicted = mtp(features, embeddings, cache=mtp.make_cache())
    logits = np.array(mtp.logits(predicted))[0]
    block_input, block_output = (np.array(a)[0] for a in recorder.seen[0])

    # Stage 1: both inputs normalised, concatenated in the layout's order, projected 2d -> d.
    fused = expected_fuse(raw, config, np.array(embeddings)[0], np.array(features)[0])
    np.testing.assert_allclose(block_input, fused, rtol=1e-4, atol=1e-4)

    # Stage 2: the decoder layer, against mlx-lm's own loading of the same weights as a target
    # layer.
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import KVCache

    reference = reference_block(path, config)
    x, cache = mx.array(block_input[None]), KVCache()
    expected = reference(x, create_attention_mask(x, cache, return_array=True), cache)
    np.testing.assert_allclose(block_output, np.array(expected)[0], rtol=1e-4, atol=1e-4)

    # Stage 3: what the next chained step reads, and the scores.
    chained, expected_logits = expected_scores(raw, config, block_output)
    np.testing.assert_allclose(np.array(predicted)[0], chained, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits, expected_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", LAYOUTS)
def test_an_exact_mtp_layer_is_accepted_at_least_90_percent(tmp_path, model_type):
    write_checkpoint(tmp_path, model_type, seed=2, exact=True, tokenizer=tiny_byte_tokenizer())
    target = load(tmp_path)
    for num_draft in (1, 3):
        tap, drafter = MTPDrafter.create(target, tmp_path, num_draft=num_draft, adaptive=False)
        source = drafter.source()
        stats = DecodingStats()
        assert tokens_of([5, 7, 11], tap, [source], max_tokens=120, stats=stats) == tokens_of(
            [5, 7, 11], target, max_tokens=120
        )
        assert stats.draft_accepted >= 0.9 * stats.draft_proposed, stats.sources["mtp"].summary()
        assert len(stats.sources["mtp"].accepted_at) == num_draft


@pytest.mark.parametrize("num_draft,adaptive", [(1, False), (2, False), (4, True)])
def test_greedy_with_mtp_drafts_equals_plain_decoding(noisy, num_draft, adaptive):
    path, target, _, _ = noisy
    stats = DecodingStats()
    for prompt in ([5, 6, 7, 8], [1], list(range(2, 30, 3))):
        tap, drafter = MTPDrafter.create(target, path, num_draft=num_draft, adaptive=adaptive)
        source = drafter.source()
        update = source.update

        def checked_update(*args):
            update(*args)  # after it, the MTP cache holds only positions read from accepted text
            assert source.cache is None or source.cache.held() == source.committed

        source.update = checked_update
        assert tokens_of(prompt, tap, [source], stats=stats) == tokens_of(prompt, target)
    if not adaptive:  # (an adaptive length may pause a drafter that is often wrong)
        assert 0 < stats.draft_accepted < stats.draft_proposed  # both paths of the rollback ran


def test_mtp_drafts_on_a_quantized_target_give_plain_decoding_with_the_same_bits(tmp_path):
    """#58: MTP drafts verified against an 8-bit cache (mimo with heads 32 wide: groups of 32 fit
    them), nearly all rejected, as this wiring's are."""
    write_checkpoint(
        tmp_path,
        "mimo",
        seed=1,
        exact=True,
        noise=0.08,
        tokenizer=tiny_byte_tokenizer(),
        hidden_size=128,
    )
    target, stats, prompt = load(tmp_path), DecodingStats(), list(range(2, 30, 3))
    quantized = dict(kv_bits=8, kv_group_size=32)
    tap, drafter = MTPDrafter.create(target, tmp_path, num_draft=3, adaptive=False)
    drafted = tokens_of(prompt, tap, [drafter.source()], stats=stats, **quantized)
    assert drafted == tokens_of(prompt, target, **quantized)
    assert 0 < stats.draft_accepted < stats.draft_proposed


@settings(max_examples=12, deadline=None)
@given(
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
    num_draft=st.integers(1, 5),
    max_tokens=st.integers(1, 30),
)
def test_greedy_with_mtp_drafts_is_lossless_for_any_prompt(noisy, prompt, num_draft, max_tokens):
    path, target, _, _ = noisy
    tap, drafter = MTPDrafter.create(target, path, num_draft=num_draft, adaptive=False)
    source = drafter.source()
    assert tokens_of(prompt, tap, [source], max_tokens=max_tokens) == tokens_of(
        prompt, target, max_tokens=max_tokens
    )


def test_the_source_is_reusable_across_generations(noisy):
    path, target, _, _ = noisy
    tap, drafter = MTPDrafter.create(target, path, num_draft=3, adaptive=False)
    source = drafter.source()
    first = tokens_of([4, 5, 6], tap, [source])
    assert tokens_of([9, 8], tap, [source]) == tokens_of([9, 8], target)
    assert tokens_of([4, 5, 6], tap, [source]) == first


@pytest.mark.parametrize("model_type", LAYOUTS)
def test_greedy_with_mtp_drafts_under_a_regex_equals_constrained_plain(tmp_path, model_type):
    from constrained import RegexConstraint

    tokenizer = tiny_byte_tokenizer()
    vocab = len(tokenizer.get_vocab())
    write_checkpoint(tmp_path, model_type, seed=3, vocab_size=vocab, tokenizer=tokenizer)
    target = load(tmp_path)
    pattern = r"(ab|12)+-[0-9]{2,5}"

    def run(sources, model):
        constraint = RegexConstraint.from_regex(pattern, tokenizer, vocab_size=vocab)
        return tokens_of([1, 2, 3], model, sources, constraint=constraint, max_tokens=12)

    tap, drafter = MTPDrafter.create(target, tmp_path, num_draft=3, adaptive=False)
    source = drafter.source()
    assert run([source], tap) == run([], target)


@pytest.mark.parametrize(
    "model_type,temp,top_p", [("deepseek_v3", 1.0, 1.0), ("qwen3_next", 0.8, 0.9)]
)
def test_sampling_with_mtp_drafts_keeps_the_target_distribution(tmp_path, model_type, temp, top_p):
    write_checkpoint(tmp_path, model_type, seed=4, vocab_size=8, tokenizer=tiny_byte_tokenizer())
    target, _, _ = load_mlx_lm(tmp_path)
    tap, drafter = MTPDrafter.create(target, tmp_path, num_draft=2, adaptive=False)
    source = drafter.source()
    assert_sampling_keeps_the_target_distribution(
        target, lambda: (tap, [source]), temp, top_p, runs=1500
    )


def test_a_model_without_mtp_weights_is_refused(tmp_path):
    write_checkpoint(
        tmp_path / "none", "qwen3_next", with_mtp=False, tokenizer=tiny_byte_tokenizer()
    )
    target, _, _ = load_mlx_lm(tmp_path / "none")
    with pytest.raises(NoMTPWeights, match="has no MTP weights"):
        load_mtp(tmp_path / "none", target)
    from tests.helpers import tiny_llama

    with pytest.raises(NoMTPWeights, match="llama: no MTP layers"):
        (tmp_path / "llama").mkdir()
        (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
        load_mtp(tmp_path / "llama", tiny_llama())


def test_mtp_weights_that_do_not_fit_are_refused(tmp_path, noisy):
    path, target, built, mtp = noisy
    config = json.loads((path / "config.json").read_text())
    weights = hf_weights(built, mtp, config)
    name = f"{mtp_prefix(config)}{projection(config['model_type'])}.weight"
    weights[name] = weights[name][:, :-1]  # a misshapen projection
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(MTPError, match="do not fit"):
        load_mtp(tmp_path, target)


@pytest.mark.parametrize("model_type", LAYOUTS)
def test_conversion_keeps_the_mtp_weights_and_quantizes_them(tmp_path, model_type):
    from loading.conversion import convert

    config, built, mtp = write_checkpoint(
        tmp_path / "hf", model_type, seed=5, exact=True, tokenizer=tiny_byte_tokenizer()
    )
    convert(str(tmp_path / "f32"), hf_path=str(tmp_path / "hf"))
    target, _, _ = load_mlx_lm(tmp_path / "f32")
    assert same_parameters(target, built) and same_parameters(
        load_mtp(tmp_path / "f32", target), mtp
    )

    convert(
        str(tmp_path / "q4"), hf_path=str(tmp_path / "hf"), quantize=True, q_bits=4, q_group_size=32
    )
    kept = mx.load(str(tmp_path / "q4" / MTP_FILE))
    name = projection(model_type)
    assert kept[f"{name}.weight"].dtype == mx.uint32 and f"{name}.scales" in kept
    target = load(tmp_path / "q4")
    tap, drafter = MTPDrafter.create(target, tmp_path / "q4", num_draft=2, adaptive=False)
    source = drafter.source()
    stats = DecodingStats()
    assert tokens_of([5, 7, 11], tap, [source], max_tokens=60, stats=stats) == tokens_of(
        [5, 7, 11], target, max_tokens=60
    )
    assert stats.draft_accepted >= 0.8 * stats.draft_proposed  # a 4-bit MTP layer still drafts


@pytest.mark.parametrize("model_type", ["qwen3_next"])  # a hybrid: the hardest of the layouts
def test_the_cli_drafts_with_mtp_and_refuses_bad_input(tmp_path, model_type):
    from tests.test_cli import assert_one_line_error, cli

    tokenizer = tiny_byte_tokenizer()
    path = tmp_path / "model"
    write_checkpoint(
        path, model_type, seed=6, vocab_size=len(tokenizer.get_vocab()), tokenizer=tokenizer
    )
    plain = json.loads(
        cli(
            "--model",
            str(path),
            "--prompt",
            "ab",
            "--no-chat-template",
            "--json",
            "--max-tokens",
            "24",
        ).stdout
    )
    result = cli(
        "--model",
        str(path),
        "--prompt",
        "ab",
        "--no-chat-template",
        "--json",
        "--max-tokens",
        "24",
        "--mtp",
        "--num-draft",
        "2",
    )
    assert result.returncode == 0, result.stderr
    drafted = json.loads(result.stdout)
    assert drafted["tokens"] == plain["tokens"] and drafted["draft_sources"]["mtp"]["proposed"] > 0

    assert_one_line_error(
        cli("--model", str(path), "--mtp", "--draft-model", str(path)), "give --mtp alone"
    )
    assert_one_line_error(cli("--model", str(path), "--mtp", "--num-draft", "0"), "--num-draft")
    write_checkpoint(
        tmp_path / "none", "deepseek_v3", with_mtp=False, tokenizer=tiny_byte_tokenizer()
    )
    result = cli("--model", str(tmp_path / "none"), "--mtp", "--max-tokens", "2")
    assert_one_line_error(result, "has no MTP weights")
    assert result.returncode == 2
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ):
        if (path / name).exists():
            (damaged / name).write_bytes((path / name).read_bytes())
    weights = mx.load(str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    fuse = mtp_prefix(config) + projection(config["model_type"])
    mx.save_safetensors(
        str(damaged / "model.safetensors"),
        {k: v for k, v in weights.items() if not k.startswith(fuse)},
    )
    assert_one_line_error(cli("--model", str(damaged), "--mtp", "--max-tokens", "2"), "do not fit")
