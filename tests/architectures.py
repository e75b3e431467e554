"""Tiny random models of mlx-lm's architectures, built the way a user's checkpoint is loaded.

    model, config = build("gemma3_text")          # ModelArgs.from_dict(config), random weights
    quantized, qconfig = quantize(model, config, bits=4)
    save(directory, quantized, qconfig)           # a directory mlx_lm.load (and main.py --model)
    reads describe_caches(model)                        # what make_cache() returns, per layer

A config is ``BASE`` (the keys most ``ModelArgs`` share, at toy sizes) under the architecture's own
keys in ``ARCHITECTURES``; ``from_dict`` ignores the keys an architecture does not know, as it does
for a real config.json. The vocabulary is SmolLM2's (49152 tokens), so the embedded model's
tokenizer serves every model. Sliding windows and attention chunks are ``WINDOW`` tokens, so a short
text passes them, and hybrid stacks hold both attention and recurrent layers.
"""

import copy
import functools
import json
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.utils import _get_classes, load_tokenizer, quantize_model
from mlx_lm.utils import save as save_model_dir

VOCAB = 49152  # SmolLM2's tokenizer
WINDOW = 8  # sliding windows and attention chunks

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    norm_eps=1e-5,
    layer_norm_eps=1e-5,
    layer_norm_epsilon=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
    rope_scaling=None,
)

MOE = dict(
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
)
MAMBA = dict(
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_n_heads=4,
    mamba_num_heads=4,
    mamba_d_head=16,
    mamba_head_dim=16,
    mamba_n_groups=1,
    n_groups=1,
    mamba_expand=2,
    mamba_proj_bias=False,
    mamba_conv_bias=True,
    ssm_state_size=16,
    state_size=16,
    conv_kernel=4,
    use_bias=False,
    use_conv_bias=True,
    mamba_chunk_size=16,
)
LINEAR_ATTENTION = dict(
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
GRANITE = dict(
    logits_scaling=1.0, attention_multiplier=0.25, embedding_multiplier=1.0, residual_multiplier=1.0
)
MLA = dict(kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
MINISTRAL_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "llama_4_scaling_beta": 0.1,
    # its attention scale grows every 16 positions
    "original_max_position_embeddings": 16,
}
QWEN3_5_ROPE = {
    "type": "default",
    "mrope_section": [2, 1, 1],
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
}
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"] * 2


def text_config(**keys) -> dict:
    """A ``text_config`` for the architectures that wrap a language model (mistral3, qwen3_5,
    ...)."""
    return {**BASE, **keys}


# Each architecture's own keys, over BASE ("model_type" defaults to the name), grouped by the caches
# their make_cache() gives (describe_caches says exactly).
ARCHITECTURES = {
    # Full attention: one KVCache per layer (none given: mlx-lm makes KVCaches).
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "phi3": {},
    "olmo2": {},
    "gemma": {},
    "cohere": {},
    "starcoder2": {},
    "internlm2": {},
    "smollm3": {},
    "helium": {},
    "seed_oss": {},
    "phi": {},
    "granite": GRANITE,
    "glm4": dict(partial_rotary_factor=0.5),
    "stablelm": dict(use_qkv_bias=False, partial_rotary_factor=0.5),
    "gpt_neox": dict(rotary_emb_base=10000.0, rotary_pct=0.5),
    "minicpm": dict(dim_model_base=64, scale_depth=1.4, scale_emb=1.0),
    "nemotron": dict(hidden_act="relu2"),
    "ernie4_5": dict(use_bias=False),
    "llama4_text": dict(intermediate_size_mlp=128, no_rope_layers=[1, 1, 1, 0], use_qk_norm=True),
    "gemma2": dict(query_pre_attn_scalar=16),
    "ministral3": dict(rope_parameters=MINISTRAL_ROPE),
    "mistral3": dict(
        text_config=text_config(model_type="ministral3", rope_parameters=MINISTRAL_ROPE)
    ),
    # ... with experts.
    "mixtral": MOE,
    "phimoe": MOE,
    "olmoe": MOE,
    "qwen3_moe": MOE,
    "qwen2_moe": {**MOE, "shared_expert_intermediate_size": 64},
    "granitemoe": {**GRANITE, **MOE},
    "deepseek_v3": {**MOE, **MLA, "n_shared_experts": 1, "first_k_dense_replace": 1},
    "deepseek_v32": {
        **MOE,
        **MLA,
        "n_shared_experts": 1,
        "index_head_dim": 16,
        "index_n_heads": 2,
        "index_topk": 4,
    },
    # Sliding windows: RotatingKVCache layers beside full ones.
    "gemma3_text": dict(sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=16),
    "gemma3": dict(
        text_config=text_config(
            model_type="gemma3_text",
            sliding_window=WINDOW,
            sliding_window_pattern=2,
            query_pre_attn_scalar=16,
        )
    ),
    "gemma4_text": dict(
        sliding_window=WINDOW,
        sliding_window_pattern=2,
        global_head_dim=32,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=VOCAB,
    ),
    "gpt_oss": {**MOE, "sliding_window": WINDOW},
    "cohere2": dict(sliding_window=WINDOW, sliding_window_pattern=2),
    "exaone4": dict(
        sliding_window=WINDOW, sliding_window_pattern="LG", layer_types=SLIDING_THEN_FULL
    ),
    "olmo3": dict(sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL),
    "plamo3": dict(sliding_window=WINDOW, sliding_window_pattern=2),
    "muse_glimmer": dict(sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL),
    "afmoe": {
        **MOE,
        "sliding_window": WINDOW,
        "layer_types": SLIDING_THEN_FULL,
        "num_dense_layers": 1,
    },
    "llama_sliding": dict(model_type="llama", sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL),
    # each layer runs twice: a KVCache, then a window
    "iquestloopcoder": dict(loop_window_size=WINDOW),
    # Attention in chunks: ChunkedKVCache.
    "llama4": dict(
        text_config=text_config(
            model_type="llama4_text",
            attention_chunk_size=WINDOW,
            interleave_moe_layer_step=2,
            intermediate_size_mlp=128,
            num_local_experts=2,
            num_experts_per_tok=1,
            use_qk_norm=True,
        )
    ),
    # Hybrids: recurrent layers (ArraysCache) beside attention.
    "qwen3_next": {
        **MOE,
        **LINEAR_ATTENTION,
        "shared_expert_intermediate_size": 64,
        "partial_rotary_factor": 0.5,
        "full_attention_interval": 2,
    },
    "qwen3_5": dict(
        text_config=text_config(
            model_type="qwen3_5_text",
            full_attention_interval=2,
            **LINEAR_ATTENTION,
            rope_parameters=QWEN3_5_ROPE,
        )
    ),
    "qwen3_5_moe": dict(
        text_config=text_config(
            model_type="qwen3_5_moe_text",
            full_attention_interval=2,
            **LINEAR_ATTENTION,
            **MOE,
            shared_expert_intermediate_size=64,
            rope_parameters=QWEN3_5_ROPE,
        )
    ),
    "lfm2": dict(
        full_attn_idxs=[1, 3],
        conv_bias=False,
        conv_L_cache=3,
        block_dim=64,
        block_ff_dim=128,
        block_multiple_of=64,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
    ),
    "lfm2_moe": {
        **MOE,
        "full_attn_idxs": [1, 3],
        "conv_bias": False,
        "conv_L_cache": 3,
        "use_expert_bias": True,
        "num_dense_layers": 1,
    },
    "falcon_h1": {**MAMBA, "mamba_d_ssm": 64},  # every layer: CacheList(ArraysCache, KVCache)
    "nemotron_h": {**MAMBA, "hybrid_override_pattern": ["M", "*", "M", "-"]},
    "granitemoehybrid": {
        **GRANITE,
        **MAMBA,
        **MOE,
        "shared_intermediate_size": 128,
        "mamba_n_heads": 8,
        "layer_types": ["mamba", "attention", "mamba", "attention"],
    },
    "jamba": {
        **MAMBA,
        **MOE,
        "attn_layer_offset": 1,
        "attn_layer_period": 2,
        "expert_layer_offset": 1,
        "expert_layer_period": 2,
    },
    "plamo2": {
        **MAMBA,
        "hidden_size_per_head": 16,
        "mamba_step": 2,
        "attention_window_size": WINDOW,
    },
    "olmo_hybrid": {**LINEAR_ATTENTION, "linear_allow_neg_eigval": False},
    "kimi_linear": {
        **MOE,
        **MLA,
        "model_max_length": 4096,
        "linear_attn_config": {
            "kda_layers": [1, 3],
            "full_attn_layers": [2, 4],
            "head_dim": 16,
            "num_heads": 4,
            "short_conv_kernel_size": 4,
        },
    },
    "bailing_moe_v3": {
        **MOE,
        **MLA,
        "num_shared_experts": 1,
        "moe_shared_expert_intermediate_size": 64,
        "n_group": 1,
        "topk_group": 1,
        "layer_group_size": 2,
    },
    # Recurrent layers beside sliding-window attention.
    "recurrent_gemma": dict(
        attention_window_size=WINDOW,
        conv1d_width=4,
        logits_soft_cap=30.0,
        block_types=["recurrent", "attention"],
    ),
    # CacheLists
    "baichuan_m1": dict(sliding_window=WINDOW, sliding_window_layers=[0, 2], conv_window=2),
    # Recurrent only.
    "mamba": {**MAMBA, "time_step_rank": 8},
    "mamba2": {
        **MAMBA,
        "num_heads": 8,
        "head_dim": 16,
        "time_step_limit": [0.0, 1e9],
        "time_step_rank": 8,
    },
    "rwkv7": dict(
        a_low_rank_dim=16, v_low_rank_dim=16, gate_low_rank_dim=16, decay_low_rank_dim=16
    ),
}


def model_config(name: str, **keys) -> dict:
    """The config.json of a tiny ``name`` (a key of ARCHITECTURES or any mlx-lm model_type),
    ``keys`` on top."""
    config = {**BASE, "model_type": name, **ARCHITECTURES.get(name, {}), **keys}
    return json.loads(json.dumps(config))  # a plain copy, as if read from disk


def build(name: str, seed: int = 0, sharp: float = 4.0, gain: float = 2.0, **keys):
    """A random tiny ``name``; returns ``(model, config)``.

    Random weights as they come make a flat, context-blind model: tied embeddings predict the
    input token again, forever. So the linear layers of the blocks are scaled by ``gain``, making
    what the layers add outweigh the token's own embedding in the residual stream, and an untied
    output projection by ``sharp``, so that greedy decoding has no near-ties for float noise to
    break differently in a batch or a quantized kernel.
    """
    config = model_config(name, **keys)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(copy.deepcopy(config)))
    head = output_projection(model)
    for layer in model.layers:
        for _, module in layer.named_modules():
            if isinstance(module, (nn.Linear, SwitchLinear)):  # SwitchLinear: a mixture's experts
                module.weight = module.weight * gain
    if isinstance(head, nn.Linear):
        head.weight = head.weight * sharp
    mx.eval(model.parameters())
    model.eval()
    return model, config


def output_projection(model) -> nn.Module:
    """The layer that turns hidden states into logits: a Linear onto the vocabulary, else the
    embedding it is tied to."""
    modules = [module for _, module in model.named_modules()]
    heads = [m for m in modules if isinstance(m, nn.Linear) and m.weight.shape[0] == VOCAB]
    heads = heads or [
        m for m in modules if isinstance(m, nn.Embedding) and m.weight.shape[0] == VOCAB
    ]
    if len(heads) != 1:
        raise ValueError(f"cannot tell which of {len(heads)} layers computes the logits")
    return heads[0]


def quantize(model, config: dict, bits: int = 4, group_size: int = 64):
    """A quantized copy of ``model`` and its config, as mlx-lm's convert makes it (mlx-community's
    defaults: group 64; layers whose width the group does not divide stay float)."""
    model = copy.deepcopy(model)
    with redirect_stdout(StringIO()):  # quantize_model prints the bits per weight
        model, config = quantize_model(model, copy.deepcopy(config), group_size, bits)
    mx.eval(model.parameters())
    return model, config


def smollm2_path() -> Path:
    """The embedded SmolLM2-135M-Instruct's directory, whose tokenizer every tiny model uses."""
    from loading.load import default_model_path

    return default_model_path()


@functools.cache
def tokenizer():
    """SmolLM2's tokenizer, as mlx_lm.load wraps it (loaded once)."""
    return load_tokenizer(smollm2_path())


def save(directory, model, config: dict) -> Path:
    """Write ``model`` with SmolLM2's tokenizer where ``mlx_lm.load`` (and so ``main.py --model``)
    reads it."""
    directory = Path(directory)
    save_model_dir(
        directory, smollm2_path(), model, tokenizer(), copy.deepcopy(config), donate_model=False
    )
    return directory


def layer_caches(model) -> list:
    """``make_prompt_cache(model)``, with a CacheList's caches in place of the list (one entry per
    cache)."""
    caches = []
    for cache in make_prompt_cache(model):
        caches += cache.caches if isinstance(cache, CacheList) else [cache]
    return caches


def window(model) -> int:
    """The longest sliding window or attention chunk among the model's caches (0: none)."""
    spans = [
        cache.max_size
        if isinstance(cache, RotatingKVCache)
        else cache.chunk_size
        if isinstance(cache, ChunkedKVCache)
        else 0
        for cache in layer_caches(model)
    ]
    return max(spans, default=0)


def describe_cache(cache) -> str:
    if isinstance(cache, CacheList):
        return f"CacheList({', '.join(describe_cache(c) for c in cache.caches)})"
    if isinstance(cache, RotatingKVCache):
        return f"RotatingKVCache({cache.max_size}{f', keep={cache.keep}' if cache.keep else ''})"
    if isinstance(cache, ChunkedKVCache):
        return f"ChunkedKVCache({cache.chunk_size})"
    if isinstance(cache, ArraysCache):
        return f"ArraysCache({len(cache.cache)})"
    return type(cache).__name__


def cache_family(model) -> str:
    """The kinds of cache the model keeps, e.g. "ArraysCache + KVCache": what the engine must
    handle."""
    kinds = " + ".join(sorted({type(cache).__name__ for cache in layer_caches(model)}))
    in_lists = any(isinstance(cache, CacheList) for cache in make_prompt_cache(model))
    return f"{kinds}, in CacheLists" if in_lists else kinds


def describe_caches(model) -> dict:
    """What ``make_cache()`` gives ``model`` and how its forward pass reads the caches.

    Returns ``{"caches": one description per cache, "layers": len(model.layers), "masks": ...}``:
    fewer caches than layers means some layers read another's cache (gemma4's shared KV) or keep
    none (nemotron_h's MLP layers). ``masks`` lists the ``make_mask`` calls of one two-token pass:
    ``(index of the cache in the list, the cache asked, the window the model passed)``.
    """
    caches = make_prompt_cache(model)
    masks = []
    for index, cache in enumerate(caches):
        for inner in cache.caches if isinstance(cache, CacheList) else [cache]:
            if hasattr(inner, "make_mask"):  # what mlx-lm's create_attention_mask asks too
                inner.make_mask = _recording(inner, index, masks)
    model(mx.array([[1, 2]]), cache=caches)
    return {
        "caches": [describe_cache(c) for c in caches],
        "layers": len(model.layers),
        "masks": masks,
    }


def _recording(cache, index: int, calls: list):
    make_mask = cache.make_mask

    def recorded(*args, **kwargs):
        calls.append((index, describe_cache(cache), kwargs.get("window_size")))
        return make_mask(*args, **kwargs)

    return recorded
