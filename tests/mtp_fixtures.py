"""Tiny checkpoints with MTP weights in the Hugging Face layout: deepseek_v3, glm4_moe, qwen3_next
(hybrid), qwen3_5 and qwen3_5_moe (hybrids wrapped as vision-language models), mimo.

``write_checkpoint`` builds a random target and MTP module with mlx-lm's classes, optionally wires
them so that the MTP layer predicts the target exactly (``exact``), and writes them under the
names Hugging Face ships (experts one by one, or fused for Qwen3.5-MoE; DeepSeek's ``kv_b_proj``
whole; Qwen's norms zero-centred; Qwen3.5's language model under ``model.language_model``), so the
loaders are tested on the layout, not on our own output.

The exact wiring (vocabulary V, width D = 2V): the target copies each token's one-hot embedding
through identity layers (every output projection zero), its final norm flips the signs ``s`` of
some dimensions, and its head predicts ``perm(x)`` (a cycle). The MTP layer's projection maps the
embedding of x_{t+1} into the first half (signed by ``s``) and the target's hidden state into the
second half (signed by ``s`` again, which undoes the final norm's flip); the head scores the first
half as ``perm`` and the second as ``perm o perm``. Both agree on x_{t+2} only if the two are
concatenated in the layout's order (MiMo's projection reads the hidden state first), the hidden
state is read after the final norm, and a chained step reads the MTP's own output.
"""

import copy
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import deepseek_v3, glm4_moe, mimo, qwen3_5, qwen3_5_moe, qwen3_next

from mtp.model import DEEPSEEK_LAYOUT, MIMO_LAYOUT, QWEN_LAYOUT, build_mtp, mtp_prefix, text_model

VOCAB = 32

DEEPSEEK = dict(
    model_type="deepseek_v3",
    architectures=["DeepseekV3ForCausalLM"],
    vocab_size=VOCAB,
    hidden_size=2 * VOCAB,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=4,
    routed_scaling_factor=1.0,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    v_head_dim=8,
    qk_nope_head_dim=8,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    norm_topk_prob=True,
    n_group=1,
    topk_group=1,
    num_experts_per_tok=2,
    moe_layer_freq=1,
    first_k_dense_replace=1,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    num_nextn_predict_layers=1,
    tie_word_embeddings=False,
)

QWEN3_NEXT = dict(
    model_type="qwen3_next",
    architectures=["Qwen3NextForCausalLM"],
    vocab_size=VOCAB,
    hidden_size=2 * VOCAB,
    num_hidden_layers=2,
    full_attention_interval=2,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    shared_expert_intermediate_size=32,
    mlp_only_layers=[],
    moe_intermediate_size=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    partial_rotary_factor=0.5,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    num_nextn_predict_layers=1,
)

GLM4_MOE = dict(
    model_type="glm4_moe",
    architectures=["Glm4MoeForCausalLM"],
    vocab_size=VOCAB,
    hidden_size=2 * VOCAB,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    n_shared_experts=1,
    n_routed_experts=4,
    routed_scaling_factor=1.0,
    n_group=1,
    topk_group=1,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=None,
    use_qk_norm=True,
    attention_bias=True,
    partial_rotary_factor=0.5,
    num_nextn_predict_layers=1,
    tie_word_embeddings=False,
)

# Qwen3.5's language model, as its config.json's ``text_config`` gives it (rope_parameters as Qwen
# ships them).
QWEN3_5_TEXT = dict(
    model_type="qwen3_5_text",
    vocab_size=VOCAB,
    hidden_size=2 * VOCAB,
    num_hidden_layers=2,
    full_attention_interval=2,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    mtp_num_hidden_layers=1,
    mtp_use_dedicated_embeddings=False,
    rope_parameters={
        "rope_type": "default",
        "mrope_section": [2, 1, 1],
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
    },
)
QWEN3_5 = dict(
    model_type="qwen3_5",
    architectures=["Qwen3_5ForConditionalGeneration"],
    tie_word_embeddings=False,
    text_config=QWEN3_5_TEXT,
)
QWEN3_5_MOE = dict(
    model_type="qwen3_5_moe",
    architectures=["Qwen3_5MoeForConditionalGeneration"],
    tie_word_embeddings=False,
    text_config={
        **QWEN3_5_TEXT,
        "model_type": "qwen3_5_moe_text",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32,
    },
)

MIMO = dict(
    model_type="mimo",
    architectures=["MiMoForCausalLM"],
    vocab_size=VOCAB,
    hidden_size=2 * VOCAB,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    num_nextn_predict_layers=1,
)

CONFIGS = {
    "deepseek_v3": DEEPSEEK,
    "qwen3_next": QWEN3_NEXT,
    "glm4_moe": GLM4_MOE,
    "qwen3_5": QWEN3_5,
    "qwen3_5_moe": QWEN3_5_MOE,
    "mimo": MIMO,
}
MODULES = {
    "deepseek_v3": deepseek_v3,
    "qwen3_next": qwen3_next,
    "glm4_moe": glm4_moe,
    "qwen3_5": qwen3_5,
    "qwen3_5_moe": qwen3_5_moe,
    "mimo": mimo,
}


def text_config(config: dict) -> dict:
    """The language model's keys: ``text_config`` where the config wraps one (Qwen3.5), else the
    config."""
    return config.get("text_config", config)


def build(model_type: str, seed: int = 0, exact: bool = False, noise: float = 0.0, **overrides):
    """``(config, target, mtp)`` in mlx-lm's layout, float32; ``overrides`` go to the language
    model's keys."""
    config = copy.deepcopy(CONFIGS[model_type])
    text_config(config).update(overrides)
    module = MODULES[model_type]
    mx.random.seed(seed)
    target = module.Model(module.ModelArgs.from_dict(config))
    mtp = build_mtp(target, config)
    rng = np.random.default_rng(seed)
    if exact:
        _wire_exactly(target, mtp, config, rng)
    else:  # sharper than mlx-lm's initialisation, so greedy ties and flat samples are rare
        text_model(target).lm_head.weight = text_model(target).lm_head.weight * 4
    if noise:
        for module_ in (target, mtp):
            module_.update(
                tree_unflatten(
                    [
                        (k, v + noise * mx.array(rng.standard_normal(v.shape), v.dtype))
                        for k, v in tree_flatten(module_.parameters())
                        if mx.issubdtype(v.dtype, mx.floating)
                    ]
                )
            )
    mx.eval(target.parameters(), mtp.parameters())
    return config, target, mtp


def _wire_exactly(target, mtp, config, rng):
    vocab, width = text_config(config)["vocab_size"], text_config(config)["hidden_size"]
    order = rng.permutation(vocab)
    perm = np.empty(vocab, np.int64)
    perm[order] = np.roll(order, -1)  # one cycle through every token
    signs = np.where(rng.random(vocab) < 0.5, -1.0, 1.0)
    signs[:2] = [1.0, -1.0]

    def zeroed(module):
        module.update(
            tree_unflatten(
                [
                    (k, mx.zeros_like(v))
                    for k, v in tree_flatten(module.parameters())
                    if k.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight"))
                ]
            )
        )

    zeroed(target)
    zeroed(mtp)
    target.model.embed_tokens.weight = mx.array(np.eye(vocab, width), mx.float32)
    target.model.norm.weight = mx.array(np.concatenate([signs, np.ones(width - vocab)]), mx.float32)
    head = np.zeros((vocab, width))
    head[perm, np.arange(vocab)] = 2 * signs
    head[perm[perm], vocab + np.arange(vocab)] = 3
    text_model(target).lm_head.weight = mx.array(head, mx.float32)
    proj = np.zeros((width, 2 * width))
    proj[np.arange(vocab), np.arange(vocab)] = signs  # the embedding's half
    proj[vocab + np.arange(vocab), width + np.arange(vocab)] = signs  # the hidden state's half
    if config["model_type"] in QWEN_LAYOUT:
        mtp.fc.weight = mx.array(proj, mx.float32)
    elif config["model_type"] in MIMO_LAYOUT:  # it reads the hidden state first
        mtp.input_proj.weight = mx.array(
            np.concatenate([proj[:, width:], proj[:, :width]], axis=1), mx.float32
        )
    else:
        mtp.eh_proj.weight = mx.array(proj, mx.float32)
        mtp.shared_head.head.weight = mx.array(head, mx.float32)


def _hf(name: str, value: mx.array, model_type: str) -> list:
    """One mlx-lm weight -> its Hugging Face names and values."""
    # the language model sits under model.language_model
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        name = name.replace("language_model.model.", "model.language_model.").replace(
            "language_model.lm_head.", "lm_head."
        )
    if ".switch_mlp." in name:
        return [
            (name.replace(".switch_mlp.", f".experts.{e}."), value[e])
            for e in range(value.shape[0])
        ]
    if model_type in QWEN_LAYOUT:
        if "norm" in name.split(".")[-2] and "linear_attn" not in name:
            return [(name, value - 1.0)]  # stored zero-centred
        if name.endswith("conv1d.weight"):
            return [(name, value.moveaxis(1, 2))]
    return [(name, value)]


def hf_weights(target, mtp, config) -> dict:
    """Every weight of the target and its MTP layer under the names a Hugging Face checkpoint
    uses."""
    model_type, prefix, weights = config["model_type"], mtp_prefix(config), {}
    named = [(k, v) for k, v in tree_flatten(target.parameters())]
    named += [(prefix + k.removeprefix("block."), v) for k, v in tree_flatten(mtp.parameters())]
    if model_type in DEEPSEEK_LAYOUT:
        named.append((f"{prefix}embed_tokens.weight", target.model.embed_tokens.weight))
        named = _join_kv_b(dict(named), config)
    if model_type == "qwen3_5_moe":
        named = _fuse_experts(dict(named))
    for name, value in named:
        weights.update(_hf(name, value, model_type))
    return weights


def _fuse_experts(weights: dict) -> list:
    """Qwen3.5-MoE ships each layer's experts fused: ``experts.gate_up_proj`` (gate, then up) and
    ``experts.down_proj``, without ``.weight``."""
    fused = []
    for name, value in weights.items():
        if name.endswith("switch_mlp.gate_proj.weight"):
            up = weights[name.replace("gate_proj", "up_proj")]
            fused.append(
                (
                    name.replace("switch_mlp.gate_proj.weight", "experts.gate_up_proj"),
                    mx.concatenate([value, up], axis=-2),
                )
            )
        elif name.endswith("switch_mlp.down_proj.weight"):
            fused.append((name.replace("switch_mlp.down_proj.weight", "experts.down_proj"), value))
        elif not name.endswith("switch_mlp.up_proj.weight"):
            fused.append((name, value))
    return fused


def _join_kv_b(weights: dict, config) -> list:
    """DeepSeek ships ``kv_b_proj`` whole; mlx-lm splits it into ``embed_q`` and ``unembed_out``."""
    joined = []
    for name, value in weights.items():
        if name.endswith("embed_q.weight") and "unembed" not in name:
            unembed = weights[name.replace("embed_q", "unembed_out")]
            kv_b = mx.concatenate([value.swapaxes(-1, -2), unembed], axis=1).reshape(
                -1, config["kv_lora_rank"]
            )
            joined.append((name.replace("embed_q", "kv_b_proj"), kv_b))
        elif not name.endswith("unembed_out.weight"):
            joined.append((name, value))
    return joined


def write_checkpoint(
    path,
    model_type: str,
    seed: int = 0,
    exact: bool = False,
    noise: float = 0.0,
    tokenizer=None,
    with_mtp: bool = True,
    **overrides,
) -> tuple:
    """Write a Hugging Face checkpoint into ``path``; returns ``(config, target, mtp)`` as built."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config, target, mtp = build(model_type, seed, exact, noise, **overrides)
    weights = hf_weights(target, mtp, config)
    if not with_mtp:
        weights = {k: v for k, v in weights.items() if not k.startswith(mtp_prefix(config))}
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return config, target, mtp
