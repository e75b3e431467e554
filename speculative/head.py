"""A feature-level draft head (EAGLE style) for a Llama-family target.

The head reads the target's last hidden state h_t (after the final norm) and the embedding
of the token x_{t+1} that follows it, fuses them with one linear layer, runs one Llama
decoder layer and predicts h_{t+1}. From its second draft step on, it reads its own
prediction in place of h_t. Tokens are scored with the target's own output matrix
restricted to a frequency-ranked sub-vocabulary (FR-Spec), so a draft step reads ~4M head
weights plus 8k output rows instead of the whole 135M-parameter target.

A head directory holds ``model.safetensors`` (float16 head weights and the sub-vocabulary
ids) and ``config.json`` (the target's args and fingerprint). ``load_head`` also reads heads
in the published EAGLE-1/2 and EAGLE-3 layouts (speculative/eagle.py); EAGLE-3 reads the
outputs of three target layers, which ``body_with_features`` collects.
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
    feature_layers = [FINAL]  # what the ``HiddenStateTap`` records for it: the last hidden state

    def __init__(self, args: llama.ModelArgs):
        super().__init__()
        self.args = args
        self.fuse = nn.Linear(2 * args.hidden_size, args.hidden_size)
        self.layer = llama.TransformerBlock(args)
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, features: mx.array, next_embeddings: mx.array, cache=None, mask=None) -> mx.array:
        """(B, L, d) target features at t (or the head's predictions) and embeddings of x_{t+1}
        -> predicted h_{t+1}.

        ``cache`` is the list from ``make_cache``, as for mlx-lm models; ``mask`` overrides the
        causal mask (training unrolls drafting with its own, see train_head.py)."""
        layer_cache = cache[0] if cache else None
        x = self.fuse(mx.concatenate([features, next_embeddings], axis=-1))
        mask = create_attention_mask(x, layer_cache) if mask is None else mask
        return self.norm(self.layer(x, mask, cache=layer_cache))

    def make_cache(self) -> list:
        return [KVCache()]


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


def output_layer(target) -> nn.Module:
    """The target's output layer: its lm_head, or the tied embedding."""
    return getattr(target, "lm_head", None) or target.model.embed_tokens


def output_weight(target) -> mx.array:
    """The target's (vocab, d) output matrix (dequantized if need be)."""
    layer = output_layer(target)
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


def check_fingerprint(expected, target, config_path) -> None:
    if not isinstance(expected, dict) or not isinstance(expected.get("shape"), dict) \
            or not isinstance(expected.get("probe"), list):
        raise HeadMismatch(f"{config_path}: 'fingerprint' must hold a 'shape' object and a 'probe' list")
    actual = fingerprint(target)
    if actual["shape"] != expected["shape"]:
        raise HeadMismatch(f"the draft head {config_path} was trained for another model "
                           f"({expected['shape']}, the target is {actual['shape']})")
    ours = np.array(actual["probe"])
    try:
        theirs = np.array(expected["probe"], dtype=np.float64)
    except (TypeError, ValueError):
        theirs = None
    if theirs is None or theirs.shape != ours.shape:
        raise HeadMismatch(f"{config_path}: 'fingerprint' has a probe of another length (a damaged config)")
    if not np.allclose(ours, theirs, rtol=FINGERPRINT_TOLERANCE, atol=FINGERPRINT_TOLERANCE * 1e-2):
        raise HeadMismatch(f"the draft head {config_path} was trained for another model "
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
              "feature_layers": head.feature_layers, "num_layers": 1,
              "training": training or {}}
    (head_dir / "config.tmp.json").write_text(json.dumps(config, indent=1, default=str))
    (head_dir / "config.tmp.json").replace(head_dir / "config.json")


def read_config(config_path) -> dict:
    """The JSON object in ``config_path``, or one line naming the file (``HeadMismatch``)."""
    try:
        config = json.loads(Path(config_path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise HeadMismatch(f"{config_path} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise HeadMismatch(f"{config_path} is not a JSON object")
    return config


def load_head(head_dir, target, dtype=None):
    """Returns ``(head, vocab_ids)`` for a head written by ``save_head`` or in a published EAGLE
    layout (speculative/eagle.py). A damaged head, or one for another target, is refused in one
    line that names the file (``HeadMismatch``)."""
    from speculative.eagle import load_eagle_head, published_layout

    head_dir = Path(head_dir or SHIPPED_HEAD)
    config_path, weights_path = head_dir / "config.json", head_dir / "model.safetensors"
    if not hasattr(target, "args") or not hasattr(target, "model"):
        raise HeadMismatch("a draft head needs a decoder-only mlx-lm target model")
    if not config_path.is_file():
        raise HeadMismatch(f"{head_dir} is not a draft head directory (needs config.json and model.safetensors)")
    config = read_config(config_path)
    if published_layout(config):
        return load_eagle_head(head_dir, config, target, dtype)
    if not weights_path.is_file():
        raise HeadMismatch(f"{head_dir} is not a draft head directory (needs config.json and model.safetensors)")
    if "fingerprint" not in config:
        raise HeadMismatch(f"{config_path} has no 'fingerprint' (neither written by train_head nor a published "
                           "EAGLE config)")
    # Heads that fused several layers or stacked decoder layers measured worse and were dropped.
    if config.get("feature_layers", [FINAL]) != [FINAL] or config.get("num_layers", 1) != 1:
        raise HeadMismatch(f"{config_path}: feature_layers {config.get('feature_layers')} with num_layers "
                           f"{config.get('num_layers')} is not a head this version reads (only [-1] with 1)")
    check_fingerprint(config["fingerprint"], target, config_path)
    try:
        weights = mx.load(str(weights_path))
    except (RuntimeError, ValueError, OSError) as error:  # a truncated or foreign file
        raise HeadMismatch(f"{weights_path} cannot be read ({str(error).splitlines()[0]})") from None
    vocab_ids = weights.pop("vocab_ids", None)
    vocab_size = target.args.vocab_size
    if vocab_ids is None or vocab_ids.ndim != 1 or vocab_ids.size == 0 or vocab_ids.min().item() < 0 \
            or vocab_ids.max().item() >= vocab_size:
        raise HeadMismatch(f"{weights_path} has no valid 'vocab_ids' (token ids below {vocab_size})")
    head = DraftHead(head_args(target.args))
    try:
        head.load_weights([(k.removeprefix("head."), v) for k, v in weights.items()], strict=True)
    except ValueError as error:  # missing, extra or misshapen weights
        raise HeadMismatch(f"{weights_path} does not match {config_path} ({str(error).splitlines()[0]})") from None
    # Compute in the target's dtype: float32 on a CPU, float16 on Apple GPUs.
    head.set_dtype(dtype or target.model.norm.weight.dtype)
    mx.eval(head.parameters())
    return head, vocab_ids.astype(mx.int32)
