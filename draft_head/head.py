"""A feature-level draft head (EAGLE style) for a Llama-family target.

The head reads the target's last hidden state h_t (after the final norm) and the embedding of the
token x_{t+1} that follows it, fuses them with one linear layer, runs one Llama decoder layer and
predicts h_{t+1}. From its second draft step on, it reads its own prediction in place of h_t. Tokens
are scored with the target's own output matrix restricted to a frequency-ranked sub-vocabulary
(FR-Spec), so a draft step reads ~4M head weights plus 8k output rows instead of the whole
135M-parameter target.

A head directory holds ``model.safetensors`` (float16 head weights and the sub-vocabulary
ids) and ``config.json`` (the target's args and fingerprint), written by ``save_head``;
``load_head`` (loading.py) reads it, and heads in the published EAGLE layouts (eagle.py).
EAGLE-3 reads the outputs of three target layers, which ``body_with_features`` collects.
"""

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from decoder.hidden_states import FINAL, output_weight

SHIPPED_HEAD = Path(__file__).parent / "heads" / "smollm2-135m"


def head_args(target_args) -> llama.ModelArgs:
    """The target's args with one layer: the head's layer has the target's width, heads and RoPE."""
    config = {k: v for k, v in vars(target_args).items() if not k.startswith("_")}
    config.update(model_type="llama", num_hidden_layers=1, layer_types=None)
    return llama.ModelArgs.from_dict(config)


class DraftHead(nn.Module):
    """Scores with ``out_rows``, the target's output rows for the head's sub-vocabulary
    (``output_rows``); ``load_head`` hands them over. A head built to be trained needs none."""

    feature_layers = [FINAL]  # what the ``HiddenStateTap`` records for it: the last hidden state

    def __init__(self, args: llama.ModelArgs, out_rows: Optional[mx.array] = None):
        super().__init__()
        self.args = args
        self.fuse = nn.Linear(2 * args.hidden_size, args.hidden_size)
        self.layer = llama.TransformerBlock(args)
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        # The leading underscore keeps the target's rows out of parameters(): never trained or
        # saved.
        self._out_rows = out_rows
        # what scoring reads beyond the head
        self.output_bytes = 0 if out_rows is None else out_rows.nbytes

    def __call__(
        self, features: mx.array, next_embeddings: mx.array, cache=None, mask=None
    ) -> mx.array:
        """(B, L, d) target features at t (or the head's predictions) and embeddings of x_{t+1}
        -> predicted h_{t+1}. ``cache`` is the list from ``make_cache``, as for mlx-lm models;
        ``mask`` overrides the causal mask (training unrolls drafting with its own, see
        head_training/train.py)."""
        layer_cache = cache[0] if cache else None
        x = self.fuse(mx.concatenate([features, next_embeddings], axis=-1))
        mask = create_attention_mask(x, layer_cache) if mask is None else mask
        return self.norm(self.layer(x, mask, cache=layer_cache))

    def logits(self, predicted: mx.array) -> mx.array:
        """(..., d) predicted features -> (..., sub-vocabulary) scores (FR-Spec)."""
        return predicted @ self._out_rows.T

    def make_cache(self) -> list:
        return [KVCache()]


def fingerprint(target) -> dict:
    """What identifies the target: its shape and a few weights (compared with a tolerance,
    so the float32 and float16 conversions of one model match and other models do not)."""
    shape = {
        key: getattr(target.args, key, None)
        for key in (
            "hidden_size",
            "num_hidden_layers",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
        )
    }
    weight = output_weight(target)
    rows = np.linspace(0, weight.shape[0] - 1, 8).astype(np.int64)
    probe = weight[mx.array(rows, mx.int32), :4].astype(mx.float32).reshape(-1)
    norm = target.model.norm.weight[:16].astype(mx.float32)
    return {"shape": shape, "probe": mx.concatenate([probe, norm]).tolist()}


def save_head(head_dir, head: DraftHead, vocab_ids: mx.array, target, training: dict = None):
    """Write the head as float16 safetensors plus a JSON config (atomically, file by file)."""
    head_dir = Path(head_dir)
    head_dir.mkdir(parents=True, exist_ok=True)
    weights = {f"head.{k}": v.astype(mx.float16) for k, v in tree_flatten(head.parameters())}
    weights["vocab_ids"] = vocab_ids.astype(mx.int32)
    mx.save_safetensors(str(head_dir / "model.tmp.safetensors"), weights)
    (head_dir / "model.tmp.safetensors").replace(head_dir / "model.safetensors")
    config = {
        "target_args": {k: v for k, v in vars(target.args).items() if not k.startswith("_")},
        "fingerprint": fingerprint(target),
        "sub_vocab_size": int(vocab_ids.size),
        "feature_layers": head.feature_layers,
        "num_layers": 1,
        "training": training or {},
    }
    (head_dir / "config.tmp.json").write_text(json.dumps(config, indent=1, default=str))
    (head_dir / "config.tmp.json").replace(head_dir / "config.json")
