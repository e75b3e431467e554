"""``load_head``: a draft head directory -> a head ready to draft, ours or a published EAGLE one.

The heads (head.py, eagle.py) are model files; this is where a directory is read and checked
against the target, and where each head is handed what it scores with: our head the target's
rows for its sub-vocabulary, EAGLE-1 the target's LM head, EAGLE-3 nothing (its own ``lm_head``).
"""

import json
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from decoder.hidden_states import (
    FINAL,
    HeadMismatch,
    check_layers_exposed,
    logits_from_hidden,
    output_layer,
    output_rows,
    read_safetensors,
)
from draft_head.eagle import Eagle1Head, Eagle3Head, eagle3_feature_layers
from draft_head.head import SHIPPED_HEAD, DraftHead, fingerprint, head_args

FINGERPRINT_TOLERANCE = 1e-2  # float16/bfloat16 conversion moves weights by < 0.4% (relative)
EMBEDDING_MIN_COSINE = 0.9  # same table (any quantization) ~1.0; another model's ~0


def load_head(head_dir, target, dtype=None):
    """Returns ``(head, vocab_ids)`` for a head written by ``save_head`` (``head_dir`` None: the one
    shipped for the embedded model) or in a published EAGLE layout, ready to draft: every head
    scores with ``head.logits``. A damaged head, or one for another target, is refused in one line
    that names the file (``HeadMismatch``). ``dtype``: the head's compute dtype (default: the
    target's)."""
    head_dir = Path(head_dir or SHIPPED_HEAD)
    config_path = head_dir / "config.json"
    if not hasattr(target, "args") or not hasattr(target, "model"):
        raise HeadMismatch("a draft head needs a decoder-only mlx-lm target model")
    if not config_path.is_file():
        raise HeadMismatch(
            f"{head_dir} is not a draft head directory (needs config.json and model.safetensors)"
        )
    try:
        config = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise HeadMismatch(f"{config_path} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise HeadMismatch(f"{config_path} is not a JSON object")
    load = load_eagle_head if published_layout(config) else load_draft_head
    return load(head_dir, config, target, dtype or target.model.norm.weight.dtype)


def load_draft_head(head_dir: Path, config: dict, target, dtype):
    """Our head (``save_head``): checked against the target's fingerprint, scored with its rows."""
    config_path, weights_path = head_dir / "config.json", head_dir / "model.safetensors"
    if not weights_path.is_file():
        raise HeadMismatch(
            f"{head_dir} is not a draft head directory (needs config.json and model.safetensors)"
        )
    if "fingerprint" not in config:
        raise HeadMismatch(
            f"{config_path} has no 'fingerprint' (neither written by save_head nor a published "
            "EAGLE config)"
        )
    # Heads that fused several layers or stacked decoder layers measured worse and were dropped.
    if config.get("feature_layers", [FINAL]) != [FINAL] or config.get("num_layers", 1) != 1:
        raise HeadMismatch(
            f"{config_path}: feature_layers {config.get('feature_layers')} with num_layers "
            f"{config.get('num_layers')} is not a head this version reads (only [-1] with 1)"
        )
    check_fingerprint(config["fingerprint"], target, config_path)
    weights, _ = read_weights(head_dir)
    vocab_ids = weights.pop("vocab_ids", None)
    vocab_size = target.args.vocab_size
    if (
        vocab_ids is None
        or vocab_ids.ndim != 1
        or vocab_ids.size == 0
        or vocab_ids.min().item() < 0
        or vocab_ids.max().item() >= vocab_size
    ):
        raise HeadMismatch(
            f"{weights_path} has no valid 'vocab_ids' (token ids below {vocab_size})"
        )
    vocab_ids = vocab_ids.astype(mx.int32)
    head = DraftHead(head_args(target.args), output_rows(target, vocab_ids))
    weights = [(k.removeprefix("head."), v) for k, v in weights.items()]
    return with_weights(head, weights, weights_path, config_path, dtype), vocab_ids


def with_weights(head, weights: list, weights_path, config_path, dtype):
    """``head`` holding ``weights`` (missing, extra or misshapen ones are refused), in ``dtype``."""
    try:
        head.load_weights(weights, strict=True)
    except ValueError as error:
        raise HeadMismatch(
            f"{weights_path} does not match {config_path} ({str(error).splitlines()[0]})"
        ) from None
    head.set_dtype(dtype)  # float32 on a CPU, float16 on Apple GPUs
    mx.eval(head.parameters())
    return head


def check_fingerprint(expected, target, config_path) -> None:
    if (
        not isinstance(expected, dict)
        or not isinstance(expected.get("shape"), dict)
        or not isinstance(expected.get("probe"), list)
    ):
        raise HeadMismatch(
            f"{config_path}: 'fingerprint' must hold a 'shape' object and a 'probe' list"
        )
    actual = fingerprint(target)
    if actual["shape"] != expected["shape"]:
        raise HeadMismatch(
            f"the draft head {config_path} was trained for another model "
            f"({expected['shape']}, the target is {actual['shape']})"
        )
    ours = np.array(actual["probe"])
    try:
        theirs = np.array(expected["probe"], dtype=np.float64)
    except (TypeError, ValueError):  # not a list of numbers
        theirs = np.zeros(0)
    if theirs.shape != ours.shape:
        raise HeadMismatch(
            f"{config_path}: 'fingerprint' has a probe of another length (a damaged config)"
        )
    if not np.allclose(ours, theirs, rtol=FINGERPRINT_TOLERANCE, atol=FINGERPRINT_TOLERANCE * 1e-2):
        raise HeadMismatch(
            f"the draft head {config_path} was trained for another model "
            "(same shape, different weights)"
        )


def published_layout(config: dict):
    """``"eagle3"``, ``"eagle1"`` (EAGLE-1/2) or None for a head config."""
    if "draft_vocab_size" in config:
        return "eagle3"
    return "eagle1" if "hidden_size" in config and "fingerprint" not in config else None


def _eagle_args(config: dict, config_path) -> llama.ModelArgs:
    if config.get("hidden_act", "silu") != "silu":
        raise HeadMismatch(
            f"{config_path}: hidden_act {config['hidden_act']!r} is not supported (only silu)"
        )
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
    if table.shape[0] != target.args.vocab_size:
        raise HeadMismatch(
            f"{weights_path}: embed_tokens has {table.shape[0]} rows, the target's vocabulary "
            f"{target.args.vocab_size}"
        )
    rows = mx.array(np.linspace(0, table.shape[0] - 1, 16).astype(np.int64), mx.int32)
    theirs, mine = (
        table[rows].astype(mx.float32),
        target.model.embed_tokens(rows).astype(mx.float32),
    )
    cosine = (theirs * mine).sum(-1) / mx.maximum(
        mx.linalg.norm(theirs, axis=-1) * mx.linalg.norm(mine, axis=-1), 1e-6
    )
    if mx.mean(cosine).item() < EMBEDDING_MIN_COSINE:
        raise HeadMismatch(
            f"the draft head {weights_path} was trained for another model (its embedding table "
            "differs from the target's)"
        )


def read_weights(head_dir: Path) -> tuple:
    """``(weights, path)``: ``model.safetensors``, else ``pytorch_model.bin`` (as most EAGLE heads
    are published) read with torch's weights-only unpickler, which runs no code from the file."""
    safetensors, pickle = head_dir / "model.safetensors", head_dir / "pytorch_model.bin"
    if safetensors.is_file():
        return read_safetensors(safetensors), safetensors
    if not pickle.is_file():
        raise HeadMismatch(f"{head_dir} has neither model.safetensors nor pytorch_model.bin")
    try:
        import torch
    except ImportError:
        raise HeadMismatch(
            f"{pickle}: reading PyTorch weights needs torch (pip install torch), or save them "
            "as model.safetensors"
        ) from None
    try:
        state = torch.load(pickle, map_location="cpu", weights_only=True)
        # numpy has no bfloat16: floats pass as float32 and take the target's dtype on loading.
        weights = {
            name: mx.array((t.float() if t.is_floating_point() else t).numpy())
            for name, t in state.items()
        }
        return weights, pickle
    except Exception as error:  # anything the unpickler refuses, or not a dict of tensors
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise HeadMismatch(f"{pickle} cannot be read ({reason})") from None


def load_eagle_head(head_dir: Path, config: dict, target, dtype):
    """Returns ``(head, vocab_ids)`` for a head in a published EAGLE layout, checked as
    ``load_head`` says."""
    config_path = head_dir / "config.json"
    args = _eagle_args(config, config_path)
    size, vocab_size = target.args.hidden_size, target.args.vocab_size
    if config.get("target_hidden_size", args.hidden_size) != size or args.hidden_size != size:
        raise HeadMismatch(
            f"the draft head {config_path} is {args.hidden_size} wide, the target {size}"
        )
    if args.vocab_size != vocab_size:
        raise HeadMismatch(
            f"the draft head {config_path} has a vocabulary of {args.vocab_size}, "
            f"the target {vocab_size}"
        )
    weights, weights_path = read_weights(head_dir)
    _check_embeddings(weights, target, weights_path)
    if published_layout(config) == "eagle3":
        # Variants of other trainers that the reference lacks: refused rather than guessed.
        if config.get("norm_before_residual") or (config.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids"
        ):
            raise HeadMismatch(
                f"{config_path}: norm_before_residual and eagle_aux_hidden_state_layer_ids are "
                "not supported (only SafeAILab's EAGLE-3 layout)"
            )
        num_layers = target.args.num_hidden_layers
        feature_layers = eagle3_feature_layers(num_layers)
        if len(set(feature_layers)) != 3 or min(feature_layers) < 0:
            raise HeadMismatch(
                f"the EAGLE-3 head {config_path} reads the inputs of layers 2, L//2 and L-3; "
                f"the target has only {num_layers} layers"
            )
        check_layers_exposed(target, feature_layers)
        draft_vocab = config["draft_vocab_size"]
        if not isinstance(draft_vocab, int) or not 0 < draft_vocab <= vocab_size:
            raise HeadMismatch(
                f"{config_path}: draft_vocab_size must be a count of tokens up to {vocab_size}"
            )
        d2t = weights.pop("d2t", mx.zeros(draft_vocab, mx.int64))  # absent when nothing is pruned
        weights.pop("t2d", None)  # the inverse map (a mask over target tokens): not needed to draft
        ids = (
            (mx.arange(draft_vocab) + d2t.astype(mx.int64)).tolist()
            if d2t.shape == (draft_vocab,)
            else []
        )
        if len(set(ids)) != draft_vocab or min(ids) < 0 or max(ids) >= vocab_size:
            raise HeadMismatch(
                f"{weights_path}: d2t does not map {draft_vocab} draft tokens onto distinct tokens "
                f"of the target's vocabulary of {vocab_size}"
            )
        head, vocab_ids = Eagle3Head(args, draft_vocab, feature_layers), mx.array(ids, mx.int32)
    else:
        output_bytes = sum(
            value.nbytes for _, value in tree_flatten(output_layer(target).parameters())
        )
        head = Eagle1Head(
            args,
            bias="fc.bias" in weights,
            target_logits=partial(logits_from_hidden, target),
            output_bytes=output_bytes,
        )
        vocab_ids = mx.arange(vocab_size, dtype=mx.int32)
    return with_weights(head, list(weights.items()), weights_path, config_path, dtype), vocab_ids
