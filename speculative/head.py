"""A feature-level draft head (EAGLE style) for a Llama-family target.

The head reads the target's features at position t and the embedding of the token
x_{t+1} that follows it, fuses them with one linear layer, runs one Llama decoder
layer and predicts h_{t+1}, the target's last hidden state (after the final norm).
Tokens are scored with the target's own output matrix restricted to a
frequency-ranked sub-vocabulary (FR-Spec), so a draft step reads ~4M head weights
plus 8k output rows instead of the whole 135M-parameter target.

The features are the target's last hidden state h_t (EAGLE-1), or the outputs of a
few of its layers, low, middle and top, each RMS-normalised and reduced to one
vector by a linear layer (EAGLE-3's fusion; ``feature_layers``). From its second
draft step on, the head reads its own prediction in their place. On SmolLM2-135M
with ~200k tokens of training text, fusion measured worse than the last hidden
state alone (speculative/README.md), so the shipped head reads only that.

A head directory holds ``model.safetensors`` (float16 head weights and the
sub-vocabulary ids) and ``config.json`` (the target's args and fingerprint).
"""

import json
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

SHIPPED_HEAD = Path(__file__).parent / "heads" / "smollm2-135m"
FINAL = -1  # in ``feature_layers``: the target's last hidden state, after its final norm
FINGERPRINT_TOLERANCE = 1e-2  # float16/bfloat16 conversion moves weights by < 0.4% (relative)


class HeadMismatch(ValueError):
    """A head that does not fit the target (the message is shown to the user)."""


def head_args(target_args) -> llama.ModelArgs:
    """The target's args with one layer: the head's layer has the target's width, heads and RoPE."""
    config = {k: v for k, v in vars(target_args).items() if not k.startswith("_")}
    config.update(model_type="llama", num_hidden_layers=1, layer_types=None)
    return llama.ModelArgs.from_dict(config)


class DraftHead(nn.Module):
    def __init__(self, args: llama.ModelArgs, feature_layers=(FINAL,), num_layers: int = 1):
        super().__init__()
        self.args = args
        self.feature_layers = list(feature_layers)
        size = args.hidden_size
        if len(self.feature_layers) > 1:
            self.feature_scales = mx.ones((len(self.feature_layers), size))
            self.reduce = nn.Linear(len(self.feature_layers) * size, size, bias=False)
            if self.feature_layers[-1] == FINAL:
                # Start as a head that reads the last hidden state only; training mixes the others in.
                self.reduce.weight = mx.concatenate(
                    [mx.zeros((size, (len(self.feature_layers) - 1) * size)), mx.eye(size)], axis=1)
        self.fuse = nn.Linear(2 * size, size)
        self.layer = llama.TransformerBlock(args)
        self.more_layers = [llama.TransformerBlock(args) for _ in range(num_layers - 1)]  # a deeper head
        self.norm = nn.RMSNorm(size, eps=args.rms_norm_eps)

    @property
    def num_layers(self) -> int:
        return 1 + len(self.more_layers)

    def reduce_features(self, features: mx.array) -> mx.array:
        """(..., k * d) features of k layers -> (..., d); the head's own predictions pass as they are."""
        size = self.args.hidden_size
        if features.shape[-1] == size:
            return features
        # Middle layers carry outliers in the tens of thousands: normalise each layer on its own.
        parts = features.reshape(*features.shape[:-1], len(self.feature_layers), size)
        parts = parts * mx.rsqrt(mx.mean(parts * parts, axis=-1, keepdims=True) + self.args.rms_norm_eps)
        return self.reduce((parts * self.feature_scales).reshape(features.shape))

    def __call__(self, features: mx.array, next_embeddings: mx.array, cache=None, mask=None) -> mx.array:
        """(B, L, k * d) target features at t (or (B, L, d) predictions) and embeddings of x_{t+1}
        -> predicted h_{t+1}.

        ``cache`` is the list from ``make_cache`` (one per layer), as for mlx-lm models; ``mask``
        overrides the causal mask (training unrolls drafting with its own, see train_head.py)."""
        cache = cache or [None] * self.num_layers
        x = self.fuse(mx.concatenate([self.reduce_features(features), next_embeddings], axis=-1))
        mask = create_attention_mask(x, cache[0]) if mask is None else mask
        for layer, layer_cache in zip([self.layer, *self.more_layers], cache):
            x = layer(x, mask, cache=layer_cache)
        return self.norm(x)

    def make_cache(self) -> list:
        return [KVCache() for _ in range(self.num_layers)]


class _LayerRecorder:
    """A decoder layer that keeps its output (everything else is the layer's)."""

    def __init__(self, layer, outputs: list):
        self.layer, self.outputs = layer, outputs

    def __getattr__(self, name):
        return getattr(self.layer, name)

    def __call__(self, *args, **kwargs):
        self.outputs.append(self.layer(*args, **kwargs))
        return self.outputs[-1]


@contextmanager
def recording(layers: list, indices: list):
    """Within the block, ``layers[i]`` for i in ``indices`` (ascending) append their outputs to the
    list this yields; the layers are put back afterwards."""
    outputs, originals = [], {i: layers[i] for i in indices}
    try:
        for i in indices:
            layers[i] = _LayerRecorder(layers[i], outputs)
        yield outputs
    finally:
        for i, layer in originals.items():
            layers[i] = layer


def check_layers_exposed(target, feature_layers) -> None:
    """Refuse a head that fuses inner layers of a target that does not expose them. A sharded body
    (distributed/sharding.py) makes only its last hidden states equal on every rank, and says so
    with ``exposes_layer_outputs = False``."""
    body, inner = target.model, [i for i in feature_layers if i != FINAL]
    layers = getattr(body, "layers", None)
    if inner and (not isinstance(layers, list) or not getattr(body, "exposes_layer_outputs", True)
                  or max(inner) >= len(layers)):
        raise HeadMismatch(f"this draft head reads layers {inner} of the target, whose body does not "
                           "expose them (a sharded target gives only its last hidden states)")


def body_with_features(target, inputs: mx.array, feature_layers, cache=None) -> tuple:
    """Run the target's body (``target.model``) once; returns its last hidden states (B, L, d)
    and the features a head reads, (B, L, k * d) for ``feature_layers`` (ascending, FINAL last)."""
    body, inner = target.model, [i for i in feature_layers if i != FINAL]
    if inner:
        check_layers_exposed(target, feature_layers)
        with recording(body.layers, inner) as outputs:
            hidden = body(inputs, cache=cache)
    else:
        hidden, outputs = body(inputs, cache=cache), []
    parts = outputs + ([hidden] if FINAL in feature_layers else [])
    return hidden, (parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1))


def output_weight(target) -> mx.array:
    """The target's (vocab, d) output matrix: its lm_head, or the tied embedding."""
    layer = getattr(target, "lm_head", None) or target.model.embed_tokens
    if hasattr(layer, "scales"):  # a quantized table: dequantize once
        return mx.dequantize(layer.weight, layer.scales, getattr(layer, "biases", None),
                             layer.group_size, layer.bits)
    return layer.weight


def logits_from_hidden(target, hidden: mx.array) -> mx.array:
    """The target's logits from its final hidden states (what its ``__call__`` returns)."""
    if hasattr(target, "lm_head"):
        return target.lm_head(hidden)
    return target.model.embed_tokens.as_linear(hidden)


def fingerprint(target) -> dict:
    """What identifies the target: its shape and a few weights (compared with a tolerance,
    so the float32 and float16 conversions of one model match and other models do not)."""
    args = target.args
    shape = {key: getattr(args, key, None) for key in (
        "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "vocab_size")}
    weight = output_weight(target)
    rows = np.linspace(0, weight.shape[0] - 1, 8).astype(np.int64)
    probe = weight[mx.array(rows), :4].astype(mx.float32).reshape(-1)
    norm = target.model.norm.weight[:16].astype(mx.float32)
    return {"shape": shape, "probe": mx.concatenate([probe, norm]).tolist()}


def check_fingerprint(expected: dict, target, head_dir) -> None:
    actual = fingerprint(target)
    if actual["shape"] != expected["shape"]:
        raise HeadMismatch(f"the draft head in {head_dir} was trained for another model "
                           f"({expected['shape']}, the target is {actual['shape']})")
    ours, theirs = np.array(actual["probe"]), np.array(expected["probe"])
    if not np.allclose(ours, theirs, rtol=FINGERPRINT_TOLERANCE, atol=FINGERPRINT_TOLERANCE * 1e-2):
        raise HeadMismatch(f"the draft head in {head_dir} was trained for another model "
                           "(same shape, different weights)")


def save_head(head_dir, head: DraftHead, vocab_ids: mx.array, target, training: dict = None):
    """Write the head as float16 safetensors plus a JSON config (atomically, file by file)."""
    head_dir = Path(head_dir)
    head_dir.mkdir(parents=True, exist_ok=True)
    weights = {f"head.{k}": v.astype(mx.float16) for k, v in tree_flatten(head.parameters())}
    weights["vocab_ids"] = vocab_ids.astype(mx.int32)
    mx.save_safetensors(str(head_dir / "model.tmp.safetensors"), weights)
    (head_dir / "model.tmp.safetensors").replace(head_dir / "model.safetensors")
    config = {"target_args": {k: v for k, v in vars(target.args).items() if not k.startswith("_")},
              "fingerprint": fingerprint(target), "sub_vocab_size": int(vocab_ids.size),
              "feature_layers": head.feature_layers, "num_layers": head.num_layers,
              "training": training or {}}
    (head_dir / "config.tmp.json").write_text(json.dumps(config, indent=1, default=str))
    (head_dir / "config.tmp.json").replace(head_dir / "config.json")


def load_head(head_dir, target, dtype=None):
    """Returns ``(head, vocab_ids)``; refuses a head trained for another target (``HeadMismatch``)."""
    head_dir = Path(head_dir or SHIPPED_HEAD)
    config_path, weights_path = head_dir / "config.json", head_dir / "model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise HeadMismatch(f"{head_dir} is not a draft head directory (needs config.json and model.safetensors)")
    if not hasattr(target, "args") or not hasattr(target, "model"):
        raise HeadMismatch("a draft head needs a decoder-only mlx-lm target model")
    config = json.loads(config_path.read_text())
    check_fingerprint(config["fingerprint"], target, head_dir)
    check_layers_exposed(target, config.get("feature_layers", [FINAL]))
    weights = mx.load(str(weights_path))
    head = DraftHead(head_args(target.args), config.get("feature_layers", [FINAL]), config.get("num_layers", 1))
    head.load_weights([(k[len("head."):], v) for k, v in weights.items() if k.startswith("head.")], strict=True)
    # Compute in the target's dtype: float32 on a CPU, float16 on Apple GPUs.
    dtype = dtype or output_weight(target).dtype
    head.set_dtype(dtype)
    mx.eval(head.parameters())
    return head, weights["vocab_ids"]
