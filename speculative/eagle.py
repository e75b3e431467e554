"""Published EAGLE draft heads (SafeAILab/EAGLE layouts) as MLX modules for mlx-lm targets.

A head directory holds ``config.json`` (a Llama config of the head) and ``model.safetensors``
or ``pytorch_model.bin``.
Two layouts are published, and both plug into ``DraftHeadSource`` like our own head: the
source feeds the head the target's features and the embedding of the next token, and feeds
its prediction back in their place while drafting.

- **EAGLE-1/2** (arXiv 2401.15077, 2406.16858): ``fc`` maps [embedding; h_t] (2d -> d, with
  bias) where h_t is the target's last hidden state after its final norm; then Llama decoder
  layers ``layers.N`` (the first has no input norm, its input is already mixed); the
  prediction goes straight to the target's own LM head.
- **EAGLE-3** (arXiv 2503.01840; config has ``draft_vocab_size``): the target's features are
  the inputs of its layers 2, L//2 and L-3 (low, middle, top), concatenated; ``fc`` reduces
  them (3d -> d, no bias). One decoder layer ``midlayer`` attends over
  [input_layernorm(embedding); hidden_norm(h)] (q, k and v read 2d), its residual is h. The
  head scores ``lm_head(norm(h))`` over a pruned draft vocabulary; draft index i is target
  token ``i + d2t[i]``. Its own predictions (d wide) skip ``fc``.
"""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from speculative.head import FINAL, HeadMismatch, check_layers_exposed

EMBEDDING_MIN_COSINE = 0.9  # same table (any quantization) ~1.0; another model's ~0


def eagle3_feature_layers(num_layers: int) -> list:
    """The target layers whose *outputs* an EAGLE-3 head reads: the reference collects the
    inputs of layers 2, L//2 and L-3, i.e. the outputs of the layers just before them."""
    return [index - 1 for index in (2, num_layers // 2, num_layers - 3)]


class Eagle1Head(nn.Module):
    """EAGLE-1/2: fc over [embedding; h] and Llama decoder layers; the target's LM head scores."""

    feature_layers = [FINAL]

    def __init__(self, args: llama.ModelArgs, bias: bool = True):
        super().__init__()
        self.args = args
        self.fc = nn.Linear(2 * args.hidden_size, args.hidden_size, bias=bias)
        self.layers = [llama.TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.layers[0].input_layernorm = nn.Identity()  # absent from the published weights

    def __call__(self, features, next_embeddings, cache=None, mask=None):
        """(B, L, d) features at t and embeddings of x_{t+1} -> (B, L, d) predicted h_{t+1}."""
        cache = cache or [None] * len(self.layers)
        x = self.fc(mx.concatenate([next_embeddings, features], axis=-1))
        mask = create_attention_mask(x, cache[0]) if mask is None else mask
        for layer, layer_cache in zip(self.layers, cache):
            x = layer(x, mask, cache=layer_cache)
        return x

    def make_cache(self) -> list:
        return [KVCache() for _ in self.layers]


class Eagle3Layer(nn.Module):
    """A Llama decoder layer whose attention reads [embedding; hidden] (2d wide)."""

    def __init__(self, args: llama.ModelArgs):
        super().__init__()
        size = args.hidden_size
        self.self_attn = llama.Attention(args)
        attention = self.self_attn
        for name, heads in (("q_proj", attention.n_heads), ("k_proj", attention.n_kv_heads),
                            ("v_proj", attention.n_kv_heads)):
            setattr(attention, name, nn.Linear(2 * size, heads * attention.head_dim, bias=False))
        self.mlp = llama.MLP(args)
        self.input_layernorm = nn.RMSNorm(size, eps=args.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(size, eps=args.rms_norm_eps)

    def __call__(self, embeddings, hidden, mask=None, cache=None):
        mixed = mx.concatenate([self.input_layernorm(embeddings), self.hidden_norm(hidden)], axis=-1)
        hidden = hidden + self.self_attn(mixed, mask, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(nn.Module):
    """EAGLE-3: fused low/middle/top features, one ``midlayer``, its own draft-vocabulary head."""

    def __init__(self, args: llama.ModelArgs, draft_vocab_size: int, feature_layers: list):
        super().__init__()
        self.args, self.feature_layers = args, list(feature_layers)
        size = args.hidden_size
        self.fc = nn.Linear(len(self.feature_layers) * size, size, bias=False)
        self.midlayer = Eagle3Layer(args)
        self.norm = nn.RMSNorm(size, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(size, draft_vocab_size, bias=False)

    def __call__(self, features, next_embeddings, cache=None, mask=None):
        """(B, L, 3d) target features at t, or (B, L, d) own predictions, and embeddings of
        x_{t+1} -> (B, L, d) predicted hidden state (before ``norm``; fed back as it is)."""
        hidden = self.fc(features) if features.shape[-1] != self.args.hidden_size else features
        layer_cache = cache[0] if cache else None
        mask = create_attention_mask(hidden, layer_cache) if mask is None else mask
        return self.midlayer(next_embeddings, hidden, mask, layer_cache)

    def logits(self, predicted: mx.array) -> mx.array:
        """Scores over the draft vocabulary (``vocab_ids`` from ``load_eagle_head`` maps them)."""
        return self.lm_head(self.norm(predicted))

    def make_cache(self) -> list:
        return [KVCache()]


def published_layout(config: dict):
    """``"eagle3"``, ``"eagle1"`` (EAGLE-1/2) or None for a head config."""
    if "draft_vocab_size" in config:
        return "eagle3"
    if "hidden_size" in config and "fingerprint" not in config:
        return "eagle1"
    return None


def _head_args(config: dict, config_path) -> llama.ModelArgs:
    if config.get("hidden_act", "silu") != "silu":
        raise HeadMismatch(f"{config_path}: hidden_act {config['hidden_act']!r} is not supported (only silu)")
    try:
        args = llama.ModelArgs.from_dict({**config, "model_type": "llama", "layer_types": None})
    except TypeError as error:  # a required key is missing
        raise HeadMismatch(f"{config_path} is not a complete Llama config ({error})") from None
    if args.num_hidden_layers < 1:
        raise HeadMismatch(f"{config_path}: num_hidden_layers must be at least 1")
    return args


def _check_embeddings(weights: dict, target, weights_path):
    """A head that ships an embedding table must ship the target's (checked on a few rows by
    cosine similarity, so a quantized target still matches); the head then uses the target's."""
    table = weights.pop("embed_tokens.weight", None)
    if table is None:
        return
    ours = target.model.embed_tokens
    if table.shape[0] != target.args.vocab_size:
        raise HeadMismatch(f"{weights_path}: embed_tokens has {table.shape[0]} rows, the target's vocabulary "
                           f"{target.args.vocab_size}")
    rows = mx.array(np.linspace(0, table.shape[0] - 1, 16).astype(np.int64))
    theirs, mine = table[rows].astype(mx.float32), ours(rows).astype(mx.float32)
    cosine = (theirs * mine).sum(-1) / mx.maximum(mx.linalg.norm(theirs, axis=-1) * mx.linalg.norm(mine, axis=-1),
                                                  1e-6)
    if mx.mean(cosine).item() < EMBEDDING_MIN_COSINE:
        raise HeadMismatch(f"the draft head {weights_path} was trained for another model (its embedding table "
                           "differs from the target's)")


def read_weights(head_dir: Path) -> tuple:
    """``(weights, path)``: ``model.safetensors``, else ``pytorch_model.bin`` (as most EAGLE heads
    are published) read with torch's weights-only unpickler, which runs no code from the file."""
    safetensors, pickle = head_dir / "model.safetensors", head_dir / "pytorch_model.bin"
    if safetensors.is_file():
        try:
            return mx.load(str(safetensors)), safetensors
        except (RuntimeError, ValueError, OSError) as error:  # a truncated or foreign file
            raise HeadMismatch(f"{safetensors} cannot be read ({str(error).splitlines()[0]})") from None
    if not pickle.is_file():
        raise HeadMismatch(f"{head_dir} has neither model.safetensors nor pytorch_model.bin")
    try:
        import torch
    except ImportError:
        raise HeadMismatch(f"{pickle}: reading PyTorch weights needs torch (pip install torch), or save them "
                           "as model.safetensors") from None
    try:
        state = torch.load(pickle, map_location="cpu", weights_only=True)
        # numpy has no bfloat16: floats pass as float32 and take the target's dtype on loading.
        return {name: mx.array((t.float() if t.is_floating_point() else t).numpy()) for name, t in state.items()}, pickle
    except Exception as error:  # anything the unpickler refuses, or not a dict of tensors
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise HeadMismatch(f"{pickle} cannot be read ({reason})") from None


def load_eagle_head(head_dir, config: dict, target, dtype=None):
    """Returns ``(head, vocab_ids)`` for a head in a published EAGLE layout; refuses in one line
    (``HeadMismatch``, naming the file) a head that does not fit ``target``."""
    head_dir = Path(head_dir)
    config_path = head_dir / "config.json"
    layout = published_layout(config)
    args = _head_args(config, config_path)
    size, vocab_size = target.args.hidden_size, target.args.vocab_size
    if config.get("target_hidden_size", args.hidden_size) != size or args.hidden_size != size:
        raise HeadMismatch(f"the draft head {config_path} is {args.hidden_size} wide, the target {size}")
    if args.vocab_size != vocab_size:
        raise HeadMismatch(f"the draft head {config_path} has a vocabulary of {args.vocab_size}, "
                           f"the target {vocab_size}")
    weights, weights_path = read_weights(head_dir)
    _check_embeddings(weights, target, weights_path)
    if layout == "eagle3":
        # Variants of other trainers that the reference lacks: refused rather than guessed.
        if config.get("norm_before_residual") or (config.get("eagle_config") or {}).get(
                "eagle_aux_hidden_state_layer_ids"):
            raise HeadMismatch(f"{config_path}: norm_before_residual and eagle_aux_hidden_state_layer_ids are "
                               "not supported (only SafeAILab's EAGLE-3 layout)")
        num_layers = target.args.num_hidden_layers
        feature_layers = eagle3_feature_layers(num_layers)
        if len(set(feature_layers)) != 3 or min(feature_layers) < 0:
            raise HeadMismatch(f"the EAGLE-3 head {config_path} reads the inputs of layers 2, L//2 and L-3; "
                               f"the target has only {num_layers} layers")
        check_layers_exposed(target, feature_layers)
        draft_vocab = config["draft_vocab_size"]
        if not isinstance(draft_vocab, int) or not 0 < draft_vocab <= vocab_size:
            raise HeadMismatch(f"{config_path}: draft_vocab_size must be a count of tokens up to {vocab_size}")
        d2t = weights.pop("d2t", mx.zeros(draft_vocab, mx.int64))  # absent when nothing is pruned
        weights.pop("t2d", None)  # the inverse map (a mask over target tokens): not needed to draft
        vocab_ids = mx.arange(draft_vocab) + d2t.astype(mx.int64) if d2t.shape == (draft_vocab,) else None
        if vocab_ids is None or vocab_ids.min().item() < 0 or vocab_ids.max().item() >= vocab_size \
                or len(set(vocab_ids.tolist())) != draft_vocab:
            raise HeadMismatch(f"{weights_path}: d2t does not map {draft_vocab} draft tokens onto distinct tokens "
                               f"of the target's vocabulary of {vocab_size}")
        head, vocab_ids = Eagle3Head(args, draft_vocab, feature_layers), vocab_ids.astype(mx.int32)
    else:
        head = Eagle1Head(args, bias="fc.bias" in weights)
        vocab_ids = mx.arange(vocab_size, dtype=mx.int32)
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as error:
        raise HeadMismatch(f"{weights_path} does not match {config_path} ({str(error).splitlines()[0]})") from None
    head.set_dtype(dtype or target.model.norm.weight.dtype)  # the target's compute dtype (never quantized)
    mx.eval(head.parameters())
    return head, vocab_ids

