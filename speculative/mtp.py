"""Multi-token prediction (MTP) layers: the draft layers a model ships for itself, as MLX modules.

DeepSeek-V3 and GLM-4.5 (``deepseek_v3``, ``glm4_moe``) and Qwen3-Next (``qwen3_next``) are trained
with one more module that reads the target's last hidden state h_t (after its final norm) and the
embedding of the token x_{t+1} that follows it, and predicts x_{t+2}. Both layouts normalise the two,
concatenate them, embedding first, project 2d -> d and run one decoder layer of the target's own kind
(a full-attention one in Qwen3-Next's hybrid stack):

- **DeepSeek/GLM** (``model.layers.{num_hidden_layers}.*``): ``enorm``, ``hnorm``, ``eh_proj``, the
  decoder layer, and ``shared_head`` (``norm`` and ``head``) to score. The embedding at position 0 is
  zeroed, as vLLM's ``deepseek_mtp.py`` does. Drafting on, the next step reads the layer's output
  before ``shared_head.norm``, as vLLM chains it (the model was trained for one step only; some
  engines chain the normed output instead).
- **Qwen3-Next** (``mtp.*``): ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``fc``, ``layers.0``
  and ``norm``; the target's LM head scores, and the next step reads the output after ``norm``. Its
  norms are stored zero-centred (weight - 1), as the target's are.

Each module has the draft head's interface (``__call__(features, next_embeddings, cache)``, ``logits``,
``make_cache``), so ``DraftHeadSource`` drafts with it (mtp_source.py). ``load_mtp`` reads the weights
from the checkpoint the target came from: a Hugging Face directory (its safetensors shards), or an
mlx-lm directory written by convert.py, which keeps them in ``mtp.safetensors`` (mlx-lm reads only
``model*.safetensors``, so the target loads as before).
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

from speculative.head import FINAL, logits_from_hidden, output_layer
from speculative.head_loading import read_safetensors

MTP_FILE = "mtp.safetensors"  # where convert.py keeps the MTP weights of an mlx-lm directory
DEEPSEEK_LAYOUT = ("deepseek_v3", "glm4_moe")
QWEN_LAYOUT = ("qwen3_next",)


class MTPError(ValueError):
    """MTP weights that cannot be used (damaged, or for another model); the message is shown to the user."""


class NoMTPWeights(MTPError):
    """A model that ships no MTP layers this code reads (the message names it)."""


class DeepSeekMTP(nn.Module):
    """DeepSeek-V3/GLM's MTP module; its decoder layer is the target's layer class at index
    ``num_hidden_layers`` (so it is a mixture of experts where the target's deep layers are)."""

    feature_layers = [FINAL]

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
        self.output_bytes = 0  # it scores with its own head (a parameter)

    def __call__(self, features: mx.array, next_embeddings: mx.array, cache=None) -> mx.array:
        """(B, L, d) target features at t (or its own outputs) and embeddings of x_{t+1} -> (B, L, d)."""
        layer_cache = cache[0] if cache else None
        # Nothing precedes position 0: no embedding there (each row has its own offset in a batch).
        offset = mx.array(0 if layer_cache is None else layer_cache.offset).reshape(-1, 1)
        first = (offset + mx.arange(next_embeddings.shape[1])) == 0
        next_embeddings = mx.where(first[..., None], 0, next_embeddings)
        x = self.eh_proj(mx.concatenate([self.enorm(next_embeddings), self.hnorm(features)], axis=-1))
        mask = create_attention_mask(x, layer_cache, return_array=True)  # MLA adds its scores to an array
        return self.block(x, mask, layer_cache)

    def logits(self, predicted: mx.array) -> mx.array:
        return self.shared_head.head(self.shared_head.norm(predicted))

    def make_cache(self) -> list:
        return [KVCache()]


class QwenMTP(nn.Module):
    """Qwen3-Next's MTP module: a full-attention decoder layer of the target's kind; the target's
    LM head (``target_logits``, a function: its weights stay out of these parameters) scores."""

    feature_layers = [FINAL]

    def __init__(self, target):
        super().__init__()
        args, size = target.args, target.args.hidden_size
        self.pre_fc_norm_embedding = nn.RMSNorm(size, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(size, eps=args.rms_norm_eps)
        self.fc = nn.Linear(2 * size, size, bias=False)
        # Index 0 with an interval of 1: full attention, and experts where the target's layer 0 has them.
        self.layers = [type(target.model.layers[0])(replace(args, full_attention_interval=1), 0)]
        self.norm = nn.RMSNorm(size, eps=args.rms_norm_eps)
        self.target_logits = partial(logits_from_hidden, target)
        self.output_bytes = sum(v.nbytes for _, v in tree_flatten(output_layer(target).parameters()))

    def __call__(self, features: mx.array, next_embeddings: mx.array, cache=None) -> mx.array:
        layer_cache = cache[0] if cache else None
        x = mx.concatenate([self.pre_fc_norm_embedding(next_embeddings), self.pre_fc_norm_hidden(features)], -1)
        x = self.fc(x)
        x = self.layers[0](x, create_attention_mask(x, layer_cache), layer_cache)
        return self.norm(x)

    def logits(self, predicted: mx.array) -> mx.array:
        return self.target_logits(predicted)

    def make_cache(self) -> list:
        return [KVCache()]


def mtp_prefix(config: dict) -> str:
    """Where a Hugging Face checkpoint of this architecture keeps its MTP weights; NoMTPWeights
    for an architecture without a layout read here."""
    model_type = config.get("model_type")
    if model_type in DEEPSEEK_LAYOUT:
        return f"model.layers.{config['num_hidden_layers']}."
    if model_type in QWEN_LAYOUT:
        return "mtp."
    raise NoMTPWeights(f"{model_type}: no MTP layers are read for this architecture (only "
                       f"{', '.join(DEEPSEEK_LAYOUT + QWEN_LAYOUT)})")


def hf_to_module(target, config: dict, weights: dict) -> dict:
    """A checkpoint's MTP weights (``prefix``-named, as Hugging Face ships them) -> the module's names,
    in mlx-lm's layout: the target's own ``sanitize`` stacks the experts (and splits DeepSeek's
    ``kv_b_proj``, dequantizes FP8) as it would for layer 0."""
    prefix = mtp_prefix(config)
    weights = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    if config["model_type"] in QWEN_LAYOUT:
        return _qwen_layout(weights, target.args.num_experts)
    own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")
    # Its copy of the embedding is the target's: the target's own is used.
    weights = {f"model.layers.0.{k}": v for k, v in weights.items() if not k.startswith("embed_tokens.")}
    sanitized = {k.removeprefix("model.layers.0."): v for k, v in target.sanitize(weights).items()}
    return {(k if k.startswith(own) else f"block.{k}"): v for k, v in sanitized.items()}


def _qwen_layout(weights: dict, num_experts: int) -> dict:
    """Qwen3-Next's ``mtp.*`` weights in mlx-lm's layout: experts stacked, norms made ``1 + weight``."""
    for name in ("up_proj", "down_proj", "gate_proj"):
        experts = [weights.pop(f"layers.0.mlp.experts.{e}.{name}.weight", None) for e in range(num_experts)]
        if num_experts and all(e is not None for e in experts):
            weights[f"layers.0.mlp.switch_mlp.{name}.weight"] = mx.stack(experts)
    return {k: (v + 1.0 if is_norm(k) and v.ndim == 1 else v) for k, v in weights.items()}


def is_norm(name: str) -> bool:
    """An RMSNorm's weight (``norm``, ``q_norm``, ``pre_fc_norm_hidden``, ...)."""
    return name.endswith(".weight") and "norm" in name.split(".")[-2]


def build_mtp(target, config: dict) -> nn.Module:
    """An MTP module for ``target`` (random weights), of the layout ``config`` names."""
    mtp_prefix(config)  # NoMTPWeights for another architecture
    return QwenMTP(target) if config["model_type"] in QWEN_LAYOUT else DeepSeekMTP(target)


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
        weights.update({k: v for k, v in read_safetensors(path, MTPError).items() if k.startswith(prefix)})
    return weights


def load_mtp(model_dir, target) -> nn.Module:
    """The MTP module of the model in ``model_dir`` (``target`` loaded from it), ready to draft:
    ``mtp.safetensors`` of a convert.py directory, else the Hugging Face shards. ``NoMTPWeights`` for
    a model without them, ``MTPError`` for weights that do not fit (both name the directory)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    try:
        prefix = mtp_prefix(config)
    except NoMTPWeights as error:
        raise NoMTPWeights(f"{model_dir}: {error}") from None
    module = build_mtp(target, config)
    converted = model_dir / MTP_FILE
    if converted.is_file():
        weights, source = read_safetensors(converted, MTPError), converted
    else:
        weights, source = hf_to_module(target, config, read_hf_mtp(model_dir, config)), model_dir
    if not weights:
        raise NoMTPWeights(f"{model_dir} ({config['model_type']}) has no MTP weights ({prefix}*); convert.py keeps "
                           "them when it converts from Hugging Face, other conversions drop them")
    if any(k.endswith(".scales") for k in weights):
        from mlx_lm.utils import infer_quant_config

        nn.quantize(module, class_predicate=lambda path, m: f"{path}.scales" in weights
                    and infer_quant_config(path, m, weights))
    try:
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as error:
        raise MTPError(f"the MTP weights in {source} do not fit {config['model_type']} "
                       f"({str(error).splitlines()[0]})") from None
    cast(module, target.model.norm.weight.dtype, getattr(target, "cast_predicate", None))
    try:
        mx.eval(module.parameters())  # read now: a file cut short fails here, not while drafting
    except (RuntimeError, ValueError) as error:
        raise MTPError(f"the MTP weights in {source} cannot be read ({str(error).splitlines()[0]})") from None
    return module


def cast(module: nn.Module, dtype, keep=None):
    """Cast ``module``'s float weights to ``dtype`` (the target's), but those the model's
    ``cast_predicate`` keeps as they are (DeepSeek's expert-score bias), as mlx-lm's convert does."""
    module.update(tree_unflatten([(k, v.astype(dtype)) for k, v in tree_flatten(module.parameters())
                                  if mx.issubdtype(v.dtype, mx.floating) and (keep is None or keep(k))]))
