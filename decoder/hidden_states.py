"""The target's hidden states, for what drafts from them (a draft head, MTP layers).

``HiddenStateTap`` wraps the target like any mlx-lm model and writes the features a drafter reads
into one more cache layer (``FeatureRows``), so they roll back, join and leave with the rows.
"""

from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from decoder.cache import Cache, ExtraRows, layers_of
from decoder.layer_caches import KVRows

FINAL = -1  # in ``feature_layers``: the target's last hidden state, after its final norm


class HeadMismatch(ValueError):
    """A head that does not fit the target (the message is shown to the user)."""


class _LayerRecorder:
    """A decoder layer that keeps its output (everything else is the layer's)."""

    def __init__(self, layer, outputs: list):
        self.layer, self.outputs = layer, outputs

    def __getattr__(self, name):
        return getattr(self.layer, name)

    def __call__(self, *args, **kwargs):
        self.outputs.append(self.layer(*args, **kwargs))
        return self.outputs[-1]


def check_layers_exposed(target, feature_layers) -> None:
    """Refuse a head that reads inner layers of a target that does not expose them: a sharded body
    has only its last hidden states equal on every rank (``exposes_layer_outputs = False``)."""
    body, inner = target.model, [i for i in feature_layers if i != FINAL]
    layers = getattr(body, "layers", None)
    if inner and (
        not isinstance(layers, list)
        or not getattr(body, "exposes_layer_outputs", True)
        or max(inner) >= len(layers)
    ):
        raise HeadMismatch(
            f"this draft head reads layers {inner} of the target, whose body does not "
            "expose them (a sharded target gives only its last hidden states)"
        )


def body_with_features(target, inputs: mx.array, feature_layers, cache=None) -> tuple:
    """Run the target's body (``target.model``) once; returns its last hidden states (B, L, d)
    and the features a head reads, (B, L, k * d) for ``feature_layers`` (ascending, FINAL last)."""
    body, inner, outputs = target.model, [i for i in feature_layers if i != FINAL], []
    if inner:
        check_layers_exposed(target, feature_layers)
        originals = list(body.layers)
        try:
            for i in inner:
                body.layers[i] = _LayerRecorder(body.layers[i], outputs)
            hidden = body(inputs, cache=cache)
        finally:
            body.layers[:] = originals  # the target is the caller's: put its layers back
    else:
        hidden = body(inputs, cache=cache)
    parts = outputs + ([hidden] if FINAL in feature_layers else [])
    return hidden, (parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1))


def output_layer(target) -> nn.Module:
    """The target's output layer: its lm_head, or the tied embedding."""
    return getattr(target, "lm_head", None) or target.model.embed_tokens


def output_weight(target) -> mx.array:
    """The target's (vocab, d) output matrix (dequantized if need be)."""
    layer = output_layer(target)
    if hasattr(layer, "scales"):  # a quantized table: dequantize once
        return mx.dequantize(
            layer.weight, layer.scales, getattr(layer, "biases", None), layer.group_size, layer.bits
        )
    return layer.weight


def output_rows(target, vocab_ids: mx.array) -> mx.array:
    """The target's output rows for ``vocab_ids``, evaluated now: MLX runs a lazy array on its
    maker thread's stream, and a server drafts on a worker thread."""
    rows = mx.take(output_weight(target), vocab_ids, axis=0)
    mx.eval(rows)
    return rows


def logits_from_hidden(target, hidden: mx.array) -> mx.array:
    """The target's logits from its final hidden states (what its ``__call__`` returns)."""
    return (
        target.lm_head(hidden)
        if hasattr(target, "lm_head")
        else target.model.embed_tokens.as_linear(hidden)
    )


class FeatureRows(KVRows, ExtraRows):
    """The target's hidden states per row and position, stored as keys so they move with the rows.
    A rewind leaves them be: the next write lands at the model's position and drops what lay past
    it, so a recurrent row that went back keeps its accepted tokens' features until fed again."""

    def for_rows(self, rows: int) -> "FeatureRows":
        return FeatureRows(rows)

    def extract(self, row: int, since: int = 0) -> Optional[tuple]:
        return None if self.keys is None else super().extract(row, since)

    def arrays(self) -> list:
        return [] if self.keys is None else [self.keys, self.values]

    def write(self, features: mx.array, positions: Optional[Sequence[int]] = None):
        """``features`` (B, L, d) at each row's model position (None: at its own end)."""
        for row, position in enumerate(positions or []):
            first, held = self.available(row)
            if first <= position < held:
                self.trim_rows([held - position if b == row else 0 for b in range(self.rows)])
            elif position != held:  # it holds none of the positions before: start again there
                starts, origins = list(self.starts), list(self.origins)
                starts[row], origins[row] = self.ends[row], self.ends[row] - position
                self._set(starts, self.ends, origins)
        batch, length, _ = features.shape
        self.update_and_fetch(features[:, None], mx.zeros((batch, 1, length, 0), features.dtype))

    def available(self, row: int) -> tuple:
        """``(first, stop)``: the positions row ``row`` holds features for."""
        return self.starts[row] - self.origins[row], self.ends[row] - self.origins[row]

    def read(self, row: int, start: int, stop: int) -> mx.array:
        """Row ``row``'s features at positions ``[start, stop)`` (``available`` says which)."""
        origin = self.origins[row]
        return self.keys[row, 0, origin + start : origin + stop]


class HiddenStateTap:
    """The target as an mlx-lm model that writes the features of ``feature_layers`` into its cache's
    ``FeatureRows`` layer on every call (``make_cache`` adds that layer)."""

    def __init__(self, target, feature_layers=(FINAL,)):
        self.target, self.feature_layers = target, feature_layers
        self.features = None  # the FeatureRows its last call wrote into

    def __getattr__(self, name):
        return getattr(self.target, name)

    def make_cache(self) -> list:
        return make_prompt_cache(self.target) + [FeatureRows(1)]

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        features = cache[-1] if cache and isinstance(cache[-1], FeatureRows) else None
        model_cache = cache[:-1] if features is not None else cache
        positions = model_positions(model_cache, features.rows) if features is not None else None
        hidden, found = body_with_features(self.target, inputs, self.feature_layers, model_cache)
        if features is not None:
            features.write(found, positions)
            self.features = features
        return logits_from_hidden(self.target, hidden)

    def features_of(self, cache: Optional[Cache]) -> Optional["FeatureRows"]:
        """The features ``cache`` keeps, or for None those of the tap's last call (one row)."""
        if cache is None:
            return self.features
        last = cache.layers[-1] if cache.layers else None
        return last if isinstance(last, FeatureRows) else None


def model_positions(cache: list, rows: int) -> Optional[list]:
    """Each row's position in the model's cache before a call; None for recurrent layers only,
    which do not count positions."""
    layer = next((layer for layer in layers_of(cache) if layer.is_trimmable()), None)
    if layer is None:
        return None
    if hasattr(layer, "origins"):  # the cache layer's rows
        return [end - origin for end, origin in zip(layer.ends, layer.origins)]
    return [layer.offset] * rows  # one row of an mlx-lm cache


def read_safetensors(path: Path, error=HeadMismatch) -> dict:
    """The arrays of one safetensors file; ``error`` for a truncated or foreign file."""
    try:
        return mx.load(str(path))
    except (RuntimeError, ValueError, OSError) as reason:
        raise error(f"{path} cannot be read ({str(reason).splitlines()[0]})") from None
