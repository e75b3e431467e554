"""A feature-level draft head (EAGLE-1 style) for a Llama-family target.

The head reads the target's last hidden state h_t (after the final norm) and the
embedding of the token x_{t+1} that follows it, fuses them with one linear layer,
runs one Llama decoder layer and predicts h_{t+1}. Tokens are scored with the
target's own output matrix restricted to a frequency-ranked sub-vocabulary
(FR-Spec), so a draft step reads ~4M head weights plus 8k output rows instead
of the whole 135M-parameter target.

A head directory holds ``model.safetensors`` (float16 head weights and the
sub-vocabulary ids) and ``config.json`` (the target's args and fingerprint).
"""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

SHIPPED_HEAD = Path(__file__).parent / "heads" / "smollm2-135m"
FINGERPRINT_TOLERANCE = 1e-2  # float16/bfloat16 conversion moves weights by < 0.4% (relative)


class HeadMismatch(ValueError):
    """A head that does not fit the target (the message is shown to the user)."""


def head_args(target_args) -> llama.ModelArgs:
    """The target's args with one layer: the head's layer has the target's width, heads and RoPE."""
    config = {k: v for k, v in vars(target_args).items() if not k.startswith("_")}
    config.update(model_type="llama", num_hidden_layers=1, layer_types=None)
    return llama.ModelArgs.from_dict(config)


class DraftHead(nn.Module):
    def __init__(self, args: llama.ModelArgs):
        super().__init__()
        self.args = args
        size = args.hidden_size
        self.fuse = nn.Linear(2 * size, size)
        self.layer = llama.TransformerBlock(args)
        self.norm = nn.RMSNorm(size, eps=args.rms_norm_eps)

    def __call__(self, features: mx.array, next_embeddings: mx.array, cache=None, mask=None) -> mx.array:
        """(B, L, d) target features h_t and embeddings of x_{t+1} -> predicted h_{t+1}.

        ``cache`` is the list from ``make_cache`` (one layer), as for mlx-lm models; ``mask``
        overrides the causal mask (training unrolls drafting with its own, see train_head.py)."""
        cache = cache[0] if cache else None
        x = self.fuse(mx.concatenate([features, next_embeddings], axis=-1))
        x = self.layer(x, create_attention_mask(x, cache) if mask is None else mask, cache=cache)
        return self.norm(x)

    def make_cache(self) -> list:
        return [KVCache()]


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
    weights = mx.load(str(weights_path))
    head = DraftHead(head_args(target.args))
    head.load_weights([(k[len("head."):], v) for k, v in weights.items() if k.startswith("head.")], strict=True)
    # Compute in the target's dtype: float32 on a CPU, float16 on Apple GPUs.
    dtype = dtype or output_weight(target).dtype
    head.set_dtype(dtype)
    mx.eval(head.parameters())
    return head, weights["vocab_ids"]
