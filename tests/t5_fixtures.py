"""Tiny random T5 checkpoints in the Hugging Face layout, built without torch.

spiece = train_tiny_spiece(tmp_path / "spiece.model")
large = make_tiny_t5_dir(tmp_path / "large", num_layers=3, spiece_model=spiece)
small = make_tiny_t5_dir(tmp_path / "small", num_layers=1, seed=1, spiece_model=spiece)
"""

import json
import random
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

VOCAB_SIZE = 99
WORDS = (
    "the a one two three four five six seven eight nine ten red green blue yellow black white "
    "small large fast slow young old new good bad dog cat bird fish horse mouse tree flower "
    "house river city mountain garden window kitchen teacher student doctor farmer runs jumps "
    "sings eats sees finds builds writes reads opens closes over under near with and or but "
    "quick brown lazy happy sad translate summarize english german french question answer "
    "morning evening winter summer because before after always never often yesterday tomorrow"
).split()


def tiny_text(num_lines: int = 400, seed: int = 0):
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(4, 12))) + "." for _ in range(num_lines)]


def train_tiny_spiece(model_file, vocab_size: int = VOCAB_SIZE) -> Path:
    """Train a sentencepiece model with T5's special ids (pad 0, eos 1, unk 2)."""
    import sentencepiece

    model_file = Path(model_file)
    model_file.parent.mkdir(parents=True, exist_ok=True)
    with open(model_file, "wb") as writer:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(tiny_text()),
            model_writer=writer,
            vocab_size=vocab_size,
            pad_id=0,
            eos_id=1,
            unk_id=2,
            bos_id=-1,
            character_coverage=1.0,
            minloglevel=2,
        )
    return model_file


def tiny_config(variant: str, num_layers: int, num_decoder_layers, d_model: int):
    """A config.json as found on the Hub: v1.0 is t5-small-like (relu, tied head
    and no tie_word_embeddings key), v1.1 flan-t5-like (gated-gelu, own head)."""
    config = {
        "architectures": ["T5ForConditionalGeneration"],
        "model_type": "t5",
        "vocab_size": VOCAB_SIZE,
        "d_model": d_model,
        "d_kv": 8,
        "d_ff": 2 * d_model,
        "num_heads": 4,
        "num_layers": num_layers,
        "num_decoder_layers": num_decoder_layers or num_layers,
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 20,
        "layer_norm_epsilon": 1e-6,
        "dropout_rate": 0.1,
        "initializer_factor": 1.0,
        "is_encoder_decoder": True,
        "decoder_start_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 0,
    }
    if variant == "v1.0":
        config["feed_forward_proj"] = "relu"
    elif variant == "v1.1":
        config["feed_forward_proj"] = "gated-gelu"
        config["tie_word_embeddings"] = False
    else:
        raise ValueError(f"variant must be 'v1.0' or 'v1.1', not {variant!r}")
    return config


def tiny_hf_weights(config, seed: int):
    """Random weights under Hugging Face names, scaled so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    d_model, d_ff = config["d_model"], config["d_ff"]
    inner = config["num_heads"] * config["d_kv"]
    gated = config["feed_forward_proj"].startswith("gated-")

    def linear(out_dim, in_dim, scale=1.0):
        return rng.normal(0, scale / np.sqrt(in_dim), (out_dim, in_dim))

    def norm():
        return 1 + 0.1 * rng.normal(size=d_model)

    weights = {"shared.weight": rng.normal(size=(config["vocab_size"], d_model))}
    stacks = [("encoder", config["num_layers"]), ("decoder", config["num_decoder_layers"])]
    for stack, num_blocks in stacks:
        attentions = ["SelfAttention"] + (["EncDecAttention"] if stack == "decoder" else [])
        for i in range(num_blocks):
            block = f"{stack}.block.{i}.layer"
            for j, name in enumerate(attentions):
                # q carries T5's folded-in 1/sqrt(d_kv) attention scale.
                weights[f"{block}.{j}.{name}.q.weight"] = linear(
                    inner, d_model, config["d_kv"] ** -0.5
                )
                for proj in "kv":
                    weights[f"{block}.{j}.{name}.{proj}.weight"] = linear(inner, d_model)
                weights[f"{block}.{j}.{name}.o.weight"] = linear(d_model, inner)
                weights[f"{block}.{j}.layer_norm.weight"] = norm()
            ff = f"{block}.{len(attentions)}"
            for wi in ["wi_0", "wi_1"] if gated else ["wi"]:
                weights[f"{ff}.DenseReluDense.{wi}.weight"] = linear(d_ff, d_model)
            weights[f"{ff}.DenseReluDense.wo.weight"] = linear(d_model, d_ff)
            weights[f"{ff}.layer_norm.weight"] = norm()
        weights[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = (
            rng.normal(size=(config["relative_attention_num_buckets"], config["num_heads"]))
        )
        weights[f"{stack}.final_layer_norm.weight"] = norm()

    if config.get("tie_word_embeddings", True):
        # Old checkpoints also store copies of the tied embedding and an unused
        # cross-attention bias table; the loader must drop them.
        for copy in [
            "encoder.embed_tokens.weight",
            "decoder.embed_tokens.weight",
            "lm_head.weight",
        ]:
            weights[copy] = weights["shared.weight"]
        weights["decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"] = (
            rng.normal(size=(config["relative_attention_num_buckets"], config["num_heads"]))
        )
    else:
        weights["lm_head.weight"] = linear(config["vocab_size"], d_model)
    return {k: mx.array(v.astype(np.float32)) for k, v in weights.items()}


def make_tiny_t5_dir(
    path,
    variant: str = "v1.1",
    seed: int = 0,
    num_layers: int = 2,
    num_decoder_layers=None,
    d_model: int = 32,
    spiece_model=None,
) -> Path:
    """Write config.json, model.safetensors (HF names) and spiece.model to `path`.

    Pass `spiece_model` to share one tokenizer between several models (a
    draft and a target); otherwise a fresh one is trained (~0.2 s).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(variant, num_layers, num_decoder_layers, d_model)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    weights = tiny_hf_weights(config, seed)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    if spiece_model is None:
        train_tiny_spiece(path / "spiece.model")
    else:
        shutil.copy(spiece_model, path / "spiece.model")
    return path
