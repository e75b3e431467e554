"""Multi-token prediction (MTP) layers: the draft layers a model ships for itself, as MLX modules.

DeepSeek-V3 and GLM-4.5 (``deepseek_v3``, ``glm4_moe``), Qwen3-Next and Qwen3.5/3.6 (``qwen3_next``,
``qwen3_5``, ``qwen3_5_moe``) and MiMo (``mimo``) are trained with one more module that reads the
target's last hidden state h_t (after its final norm) and the embedding of the token x_{t+1} that
follows it, and predicts x_{t+2}. Every layout normalises the two, concatenates them, projects
2d -> d (``fuse``) and runs one decoder layer of the target's own kind (a full-attention one in the
Qwen hybrids' stacks, with experts where the target has them):

- **DeepSeek/GLM** (``model.layers.{num_hidden_layers}.*``): ``enorm``, ``hnorm``, ``eh_proj``, the
  decoder layer, and ``shared_head`` (``norm`` and ``head``) to score. The embedding comes first and
  is zeroed at position 0, as vLLM's ``deepseek_mtp.py`` does. Drafting on, the next step reads the
  layer's output before ``shared_head.norm``, as vLLM chains it (the model was trained for one step
  only; some engines chain the normed output instead).
- **Qwen3-Next, Qwen3.5** (``mtp.*``): ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``fc``
  (embedding first), ``layers.0`` and ``norm``; the target's LM head scores, and the next step reads
  the output after ``norm``. Its norms are stored zero-centred (weight - 1), as the target's are.
  Qwen3.5 wraps its language model (``model.language_model.*``, config in ``text_config``) but keeps
  ``mtp.*`` at the top, with the MoE variant's experts fused (``experts.gate_up_proj``).
- **MiMo** (``model.mtp_layers.0.*``): ``token_layernorm``, ``hidden_layernorm``, ``input_proj``
  (the hidden state first), the decoder layer's weights beside them, and ``final_layernorm``; the
  target's LM head scores, and the next step reads the normed output. Position 0's embedding is
  zeroed, as vLLM's ``mimo_mtp.py`` does.

Each module has the draft head's interface (``__call__(features, next_embeddings, cache)``,
``logits``, ``make_cache``), so ``MTPSource`` (source.py) drafts with it as ``DraftHeadSource``
does with a head. ``load_mtp`` reads the weights from the checkpoint the target came from: a
Hugging Face directory (its safetensors shards), or an mlx-lm directory written by convert.py,
which keeps them in ``mtp.safetensors`` (mlx-lm reads only ``model*.safetensors``, so the target
loads as before).
"""

import json
from dataclasses import replace
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from decoder.hidden_states import FINAL, logits_from_hidden, output_layer, read_safetensors

MTP_FILE = "mtp.safetensors"  # where convert.py keeps the MTP weights of an mlx-lm directory
DEEPSEEK_LAYOUT = ("deepseek_v3", "glm4_moe")
QWEN_LAYOUT = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
MIMO_LAYOUT = ("mimo",)
MTP_ARCHITECTURES = DEEPSEEK_LAYOUT + QWEN_LAYOUT + MIMO_LAYOUT


class MTPError(ValueError):
    """MTP weights that cannot be used (damaged, or for another model); the message is shown to the
    user."""


class NoMTPWeights(MTPError):
    """A model that ships no MTP layers this code reads (the message names it)."""


def text_model(target) -> nn.Module:
    """The language model in ``target``: mlx-lm's Qwen3.5 wraps it (``language_model``, which holds
    the args, layers and LM head an MTP layer reads); other targets are their own."""
    return getattr(target, "language_model", target)


def fuse(
    projection,
    embedding_norm,
    hidden_norm,
    embeddings: mx.array,
    features: mx.array,
    hidden_first: bool = False,
) -> mx.array:
    """An MTP layer's input: ``projection(cat[embedding_norm(e), hidden_norm(h)])``, 2d -> d; MiMo
    concatenates the hidden state first. The order is the checkpoint's: the other one drafts
    noise."""
    parts = [embedding_norm(embeddings), hidden_norm(features)]
    return projection(mx.concatenate(parts[::-1] if hidden_first else parts, axis=-1))


def zero_first_embedding(next_embeddings: mx.array, layer_cache) -> mx.array:
    """Nothing precedes position 0, so no embedding is read there (vLLM's DeepSeek and MiMo MTP).
    In a batch each row has its own offset."""
    offset = mx.array(0 if layer_cache is None else layer_cache.offset, mx.int32).reshape(-1, 1)
    first = (offset + mx.arange(next_embeddings.shape[1])) == 0
    return mx.where(first[..., None], 0, next_embeddings)


class MTPModule(nn.Module):
    """What every MTP module shares: it reads the target's final hidden states, keeps one KV cache,
    and scores with ``scorer``'s LM head (a function: the target's weights stay out of its
    parameters), or with its own (``scorer`` None, ``logits`` overridden)."""

    feature_layers = [FINAL]
    own_weights = ()  # checkpoint names beside the decoder layer's (``block.*`` in the module)

    def __init__(self, scorer=None):
        super().__init__()
        self.target_logits = None if scorer is None else partial(logits_from_hidden, scorer)
        # What a draft step reads beyond the module: the target's output matrix, where it scores
        # with it.
        self.output_bytes = (
            0
            if scorer is None
            else sum(v.nbytes for _, v in tree_flatten(output_layer(scorer).parameters()))
        )

    def logits(self, predicted: mx.array) -> mx.array:
        return self.target_logits(predicted)

    def make_cache(self) -> list:
        return [KVCache()]


class DeepSeekMTP(MTPModule):
    """DeepSeek-V3/GLM's MTP module; its decoder layer is the target's layer class at index
    ``num_hidden_layers`` (so it is a mixture of experts where the target's deep layers are)."""

    own_weights = ("enorm", "hnorm", "eh_proj", "shared_head")

    def __init__(self, target):
        super().__init__()
        args, size = target.args, target.args.hidden_size
        self.enorm = nn.RMSNorm(size, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(size, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * size, size, bias=False)
        self.block = type(target.model.layers[0])(args, args.num_hidden_layers)
        self.shared_head = nn.Module()
        self.shared_head.norm = nn.RMSNorm(size, eps=args.rms_norm_eps)
        self.shared_head.head = nn.Linear(size, args.vocab_size, bias=False)

    def __call__(self, features: mx.array, next_embeddings: mx.array, cache=None) -> mx.array:
        """(B, L, d) target features at t (or its own outputs) and embeddings of x_{t+1} -> (B, L,
        d)."""
        layer_cache = cache[0] if cache else None
        x = fuse(
            self.eh_proj,
            self.enorm,
            self.hnorm,
            zero_first_embedding(next_embeddings, layer_cache),
            features,
        )
        # MLA adds its scores to an array
        mask = create_attention_mask(x, layer_cache, return_array=True)
        return self.block(x, mask, layer_cache)

    def logits(self, predicted: mx.array) -> mx.array:
        return self.shared_head.head(self.shared_head.norm(predicted))


class QwenMTP(MTPModule):
    """Qwen3-Next's and Qwen3.5's MTP module: a full-attention decoder layer of the target's
    kind."""

    def __init__(self, target):
        language = text_model(target)
        super().__init__(scorer=language)
        args, size = language.args, language.args.hidden_size
        self.pre_fc_norm_embedding = nn.RMSNorm(size, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(size, eps=args.rms_norm_eps)
        self.fc = nn.Linear(2 * size, size, bias=False)
        # Index 0 with an interval of 1: full attention, and experts where the target's layer 0 has
        # them.
        self.layers = [type(language.model.layers[0])(replace(args, full_attention_interval=1), 0)]
        self.norm = nn.RMSNorm(size, eps=args.rms_norm_eps)

    def __call__(self, features: mx.array, next_embeddings: mx.array, cache=None) -> mx.array:
        layer_cache = cache[0] if cache else None
        x = fuse(
            self.fc, self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, next_embeddings, features
        )
        x = self.layers[0](x, create_attention_mask(x, layer_cache), layer_cache)
        return self.norm(x)


class MiMoMTP(MTPModule):
    """MiMo's MTP module: the target's decoder layer between the fuse and a final norm."""

    own_weights = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")

    def __init__(self, target):
        super().__init__(scorer=target)
        args, size = target.args, target.args.hidden_size
        self.token_layernorm = nn.RMSNorm(size, eps=args.rms_norm_eps)
        self.hidden_layernorm = nn.RMSNorm(size, eps=args.rms_norm_eps)
        self.input_proj = nn.Linear(2 * size, size, bias=False)
        self.block = type(target.model.layers[0])(args)
        self.final_layernorm = nn.RMSNorm(size, eps=args.rms_norm_eps)

    def __call__(self, features: mx.array, next_embeddings: mx.array, cache=None) -> mx.array:
        layer_cache = cache[0] if cache else None
        x = fuse(
            self.input_proj,
            self.token_layernorm,
            self.hidden_layernorm,
            zero_first_embedding(next_embeddings, layer_cache),
            features,
            hidden_first=True,
        )
        return self.final_layernorm(
            self.block(x, create_attention_mask(x, layer_cache), layer_cache)
        )


MTP_CLASSES = {
    **dict.fromkeys(DEEPSEEK_LAYOUT, DeepSeekMTP),
    **dict.fromkeys(QWEN_LAYOUT, QwenMTP),
    **dict.fromkeys(MIMO_LAYOUT, MiMoMTP),
}


def mtp_prefix(config: dict) -> str:
    """Where a Hugging Face checkpoint of this architecture keeps its MTP weights; NoMTPWeights
    for an architecture without a layout read here."""
    model_type = config.get("model_type")
    if model_type in DEEPSEEK_LAYOUT:
        return f"model.layers.{config['num_hidden_layers']}."
    if model_type in QWEN_LAYOUT:
        return "mtp."
    if model_type in MIMO_LAYOUT:
        return "model.mtp_layers.0."  # MiMo-7B ships one; vLLM drafts with the first alone too
    raise NoMTPWeights(
        f"{model_type}: no MTP layers are read for this architecture (only "
        f"{', '.join(MTP_ARCHITECTURES)})"
    )


def hf_to_module(target, config: dict, weights: dict) -> dict:
    """A checkpoint's MTP weights (``prefix``-named, as Hugging Face ships them) -> the module's
    names, in mlx-lm's layout: for DeepSeek/GLM and MiMo, the target's own ``sanitize`` treats the
    decoder layer as it would layer 0 (stacks the experts, splits DeepSeek's ``kv_b_proj``,
    dequantizes FP8)."""
    prefix = mtp_prefix(config)
    weights = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    if config["model_type"] in QWEN_LAYOUT:
        return _qwen_layout(weights, text_model(target).args.num_experts)
    own = tuple(f"{name}." for name in MTP_CLASSES[config["model_type"]].own_weights)
    # DeepSeek's copy of the embedding is the target's: the target's own is used.
    weights = {
        f"model.layers.0.{k}": v for k, v in weights.items() if not k.startswith("embed_tokens.")
    }
    sanitized = {k.removeprefix("model.layers.0."): v for k, v in target.sanitize(weights).items()}
    return {(k if k.startswith(own) else f"block.{k}"): v for k, v in sanitized.items()}


def _qwen_layout(weights: dict, num_experts: int) -> dict:
    """Qwen's ``mtp.*`` weights in mlx-lm's layout: experts stacked (Qwen3-Next ships them one by
    one, Qwen3.5 fused as ``gate_up_proj`` and ``down_proj``), norms made ``1 + weight``."""
    experts = "layers.0.mlp.experts."
    for name in ("up_proj", "down_proj", "gate_proj"):
        found = [weights.pop(f"{experts}{e}.{name}.weight", None) for e in range(num_experts)]
        if num_experts and all(e is not None for e in found):
            weights[f"layers.0.mlp.switch_mlp.{name}.weight"] = mx.stack(found)
    if f"{experts}gate_up_proj" in weights:  # (experts, 2 * intermediate, d): gate, then up
        gate_up = weights.pop(f"{experts}gate_up_proj")
        half = gate_up.shape[-2] // 2
        weights["layers.0.mlp.switch_mlp.gate_proj.weight"] = gate_up[..., :half, :]
        weights["layers.0.mlp.switch_mlp.up_proj.weight"] = gate_up[..., half:, :]
    if f"{experts}down_proj" in weights:
        weights["layers.0.mlp.switch_mlp.down_proj.weight"] = weights.pop(f"{experts}down_proj")
    return {k: (v + 1.0 if is_norm(k) and v.ndim == 1 else v) for k, v in weights.items()}


def is_norm(name: str) -> bool:
    """An RMSNorm's weight (``norm``, ``q_norm``, ``pre_fc_norm_hidden``, ...)."""
    return name.endswith(".weight") and "norm" in name.split(".")[-2]


def build_mtp(target, config: dict) -> nn.Module:
    """An MTP module for ``target`` (random weights), of the layout ``config`` names."""
    mtp_prefix(config)  # NoMTPWeights for another architecture
    return MTP_CLASSES[config["model_type"]](target)


def read_hf_mtp(model_dir: Path, config: dict) -> dict:
    """The MTP weights of a Hugging Face checkpoint, by their names there, read only from the shards
    that hold them (DeepSeek-V3 has 163); empty when it has none."""
    prefix, index = mtp_prefix(config), model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for name, f in weight_map.items() if name.startswith(prefix)})
    else:
        files = sorted(model_dir.glob("model*.safetensors"))
    weights = {}
    for path in files:
        weights.update(
            {k: v for k, v in read_safetensors(path, MTPError).items() if k.startswith(prefix)}
        )
    return weights


def load_mtp(model_dir, target) -> nn.Module:
    """The MTP module of the model in ``model_dir`` (``target`` loaded from it, or its
    ``text_model``), ready to draft: ``mtp.safetensors`` of a convert.py directory, else the Hugging
    Face shards. ``NoMTPWeights`` for a model without them, ``MTPError`` for weights that do not fit
    (both name the directory)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    try:
        prefix = mtp_prefix(config)
    except NoMTPWeights as error:
        raise NoMTPWeights(f"{model_dir}: {error}") from None
    module = build_mtp(target, config)
    converted = model_dir / MTP_FILE
    source = converted if converted.is_file() else model_dir
    weights = (
        read_safetensors(converted, MTPError)
        if converted.is_file()
        else read_hf_mtp(model_dir, config)
    )
    if not weights:
        raise NoMTPWeights(
            f"{model_dir} ({config['model_type']}) has no MTP weights ({prefix}*); "
            "convert.py keeps them when it converts from Hugging Face, other conversions drop them"
        )
    try:
        if not converted.is_file():
            weights = hf_to_module(target, config, weights)
        if any(k.endswith(".scales") for k in weights):
            from mlx_lm.utils import infer_quant_config

            nn.quantize(
                module,
                class_predicate=lambda path, m: (
                    f"{path}.scales" in weights and infer_quant_config(path, m, weights)
                ),
            )
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as error:
        raise MTPError(
            f"the MTP weights in {source} do not fit {config['model_type']} "
            f"({str(error).splitlines()[0]})"
        ) from None
    cast(module, target.model.norm.weight.dtype, getattr(target, "cast_predicate", None))
    try:
        mx.eval(module.parameters())  # read now: a file cut short fails here, not while drafting
    except (RuntimeError, ValueError) as error:
        raise MTPError(
            f"the MTP weights in {source} cannot be read ({str(error).splitlines()[0]})"
        ) from None
    return module


def cast(module: nn.Module, dtype, keep=None):
    """Cast ``module``'s float weights to ``dtype`` (the target's), but those the model's
    ``cast_predicate`` keeps as they are (DeepSeek's expert-score bias), as mlx-lm's convert
    does."""
    module.update(
        tree_unflatten(
            [
                (k, v.astype(dtype))
                for k, v in tree_flatten(module.parameters())
                if mx.issubdtype(v.dtype, mx.floating) and (keep is None or keep(k))
            ]
        )
    )
