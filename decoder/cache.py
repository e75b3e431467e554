"""A model's cache for 1 to B rows that each roll back alone, for every kind of layer mlx-lm builds:
one class per kind (``layer_caches.py``: ``KVRows``, ``StateRows``, ``ChunkedRows``; ``ExtraRows``
for a model wrapper's own layer), a table from mlx-lm's classes to them (``_kind``), and ``Cache``,
the operations on rows applied to every layer. How each kind rolls back: docs/decoder.md.

    cache = make_cache(model)              # Cache: its layers are what the model is called with
    cache.checkpoint()                     # before a pass with a draft
    logits = model(inputs, cache=cache.layers)
    cache.rewind(trims=[3], restored=[])   # row 0 drops the pass's last 3 tokens (checked)
    save_prompt_cache(path, cache.layers)  # mlx-lm's file; cache_file.load_cache reads it back
"""

from dataclasses import dataclass
from functools import partial
from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from .layer_caches import ChunkedRows, KVRows, QuantizedKVRows, StateRows, each_part, parts_of


class ExtraRows:
    """A per-row layer a model wrapper keeps after the model's own (a head's features). ``Cache``
    filters and extends it with the rows; by default the rest leaves it be."""

    def for_rows(self, rows: int) -> "ExtraRows":  # an empty one for ``make_cache``
        raise NotImplementedError

    def rewind(self, trims: Sequence[int]):
        pass

    def realign(self):
        pass

    def extract(self, row: int, since: int = 0) -> Optional[tuple]:
        return None

    def fill(self, row: int, keys, values, first: int):
        pass

    def arrays(self) -> list:
        return []

    def compact(self, width: int, kept: Sequence):
        """After a tree pass (``Cache.takes_trees`` lets only ``KVRows`` layers take one)."""
        raise NotImplementedError


class CacheKindError(ValueError):
    """A layer cache that drafts cannot be rolled back in (the message names it)."""


def architecture(model) -> str:
    """The model's ``model_type`` (mlx-lm's name for its architecture), to name it in a refusal."""
    return getattr(getattr(model, "args", None), "model_type", None) or type(model).__name__


def _kind(layer, rows: int, max_rollback: Optional[int], mask_dims: int, quantized=None):
    """One ``make_prompt_cache`` layer in its kind here: a renaming table. ``quantized``: ``(bits,
    group_size)`` for attention layers kept quantized."""
    if isinstance(layer, CacheList):
        return CacheList(
            *(_kind(child, rows, max_rollback, mask_dims, quantized) for child in layer.caches)
        )
    attention = KVRows if quantized is None else partial(QuantizedKVRows, bits=quantized[0])
    if quantized is not None:
        attention = partial(attention, group_size=quantized[1])
    if isinstance(layer, ExtraRows):
        return layer.for_rows(rows)
    if isinstance(layer, RotatingKVCache):
        if layer.keep:
            raise CacheKindError(
                f"a sliding-window cache that always keeps its first {layer.keep} tokens "
                "cannot be rolled back yet"
            )
        return attention(
            rows, window=layer.max_size, max_rollback=max_rollback, mask_dims=mask_dims
        )
    if type(layer) is KVCache:
        return attention(rows, mask_dims=mask_dims)
    if type(layer) is ArraysCache:
        return StateRows(len(layer.cache), rows)
    if type(layer) is ChunkedKVCache and rows == 1:
        return ChunkedRows(layer.chunk_size)
    what = "be batched" if rows > 1 and type(layer) is ChunkedKVCache else "be rolled back"
    raise CacheKindError(f"its {type(layer).__name__} layers cannot {what}")


def layers_of(cache: list) -> list:
    """Every layer cache, with the children of a ``CacheList`` in its place."""
    return [
        leaf
        for layer in cache
        for leaf in (layers_of(layer.caches) if isinstance(layer, CacheList) else [layer])
    ]


@dataclass(frozen=True)
class CachedPrefix:
    """One row's cache for the first ``length`` tokens of its text, for a later prompt that extends
    them. A recurrent state holds no shorter prefix: only a prompt that extends them all uses it."""

    length: int
    attention: list  # per attention layer, (keys, values, first): positions [first, length)
    states: list  # per recurrent layer, its state arrays
    shortest: int = 0  # the shortest length it can be cut to (a sliding layer needs its window)
    extra: tuple = ()  # per ``ExtraRows`` layer, its entry or None

    def usable(self, common: int) -> int:
        """The longest prefix of at most ``common`` tokens it can serve; 0 for none."""
        if self.states:
            return self.length if common >= self.length else 0
        return min(common, self.length) if common >= self.shortest else 0

    def cut(self, length: int) -> "CachedPrefix":
        """The entries of the first ``length`` tokens (``usable`` says which lengths it has)."""
        if length == self.length:
            return self

        def head(keys, values, first):  # the entry's positions before ``length``
            return (
                each_part(lambda part: part[:, :, : max(length - first, 0)], keys),
                each_part(lambda part: part[:, :, : max(length - first, 0)], values),
                first,
            )

        extra = tuple(None if entry is None else head(*entry) for entry in self.extra)
        return CachedPrefix(
            length, [head(*entry) for entry in self.attention], [], self.shortest, extra
        )

    def arrays(self) -> list:
        attention = self.attention + [entry for entry in self.extra if entry is not None]
        stored = [
            part for keys, values, _ in attention for part in parts_of(keys) + parts_of(values)
        ]
        return stored + [array for layer in self.states for array in layer]


class Cache:
    """A model's cache for ``rows`` rows: ``layers`` (what the model is called with) and the
    operations on rows, applied to every layer at once."""

    # (start, bits, group_size): the attention layers turn quantized once the row holds ``start``
    # tokens (``make_cache``'s ``quantized_kv_start``)
    quantize_at = None

    def __init__(self, layers: list, rows: int):
        self.layers, self.rows = layers, rows
        leaves = layers_of(layers)
        self.extra = [layer for layer in leaves if isinstance(layer, ExtraRows)]
        self.attention = [
            layer for layer in leaves if layer.is_trimmable() and not isinstance(layer, ExtraRows)
        ]
        self.recurrent = [layer for layer in leaves if isinstance(layer, StateRows)]
        self.in_tree = False  # between ``prepare`` and ``finalize`` of a tree pass

    @classmethod
    def of(
        cls,
        model,
        rows: int = 1,
        max_rollback: Optional[int] = None,
        mask_dims: int = 4,
        quantized: Optional[tuple] = None,
    ) -> "Cache":
        """``max_rollback``, ``mask_dims``: see ``KVRows``; ``quantized``: ``(bits, group_size,
        start)`` of attention layers kept quantized (``QuantizedKVRows``) from ``start`` tokens."""
        start = quantized[2] if quantized is not None else 0
        if quantized is not None:
            check_quantizable(model)
            if start and rows > 1:  # one pass would need some rows quantized and others not
                raise ValueError("quantized_kv_start applies to one row; a batch quantizes from 0")
        layers = make_prompt_cache(model)
        kept = quantized[:2] if quantized is not None and not start else None
        try:
            cache = cls(
                [_kind(layer, rows, max_rollback, mask_dims, kept) for layer in layers], rows
            )
        except CacheKindError as error:
            raise CacheKindError(f"{architecture(model)}: {error}") from None
        if start:
            cache.quantize_at = (start, *quantized[:2])
        return cache

    def held(self, row: int = 0) -> Optional[int]:
        """How many tokens row ``row`` holds (None with recurrent layers only)."""
        if not self.attention:
            return None
        layer = self.attention[0]
        return (
            layer.offset if isinstance(layer, ChunkedRows) else layer.ends[row] - layer.origins[row]
        )

    def can_trim(self, row: int = 0) -> int:
        """How many of its last tokens row ``row`` can drop (``rewind``), in every layer."""
        return min((layer.can_trim(row) for layer in self.attention), default=0)

    @property
    def ends(self) -> list:
        """Each row's end slot (all 0 for a model without attention layers: nothing drifts)."""
        return list(self.attention[0].ends) if self.attention else [0] * self.rows

    def arrays(self) -> list:
        """Every array the cache holds (to evaluate)."""
        states = [state for layer in self.recurrent for state in layer.cache if state is not None]
        extra = [array for layer in self.extra for array in layer.arrays()]
        return (
            [
                array
                for layer in self.attention
                if layer.keys is not None
                for array in parts_of(layer.keys) + parts_of(layer.values)
            ]
            + states
            + extra
        )

    def until_quantized(self) -> Optional[int]:
        """How many tokens the next pass may feed before the cache turns quantized (None: any),
        quantizing it first once it holds ``quantized_kv_start`` tokens. No pass spans that
        point, so each token past it sees a quantized cache however the passes were cut: drafts
        and a restored prompt give plain decoding's output."""
        if self.quantize_at is not None and self.held() >= self.quantize_at[0]:
            self._quantize()
        return None if self.quantize_at is None else self.quantize_at[0] - self.held()

    def _quantize(self):
        """Every attention layer as ``QuantizedKVRows`` from now on (``quantize_at``)."""
        _, bits, group_size = self.quantize_at
        self.quantize_at = None
        kept = [layer for layer in self.attention if isinstance(layer, KVRows)]  # not chunked
        new = {id(layer): layer.quantized(bits, group_size) for layer in kept}

        def swapped(layer):
            if isinstance(layer, CacheList):
                return CacheList(*(swapped(child) for child in layer.caches))
            return new.get(id(layer), layer)

        self.layers[:] = [swapped(layer) for layer in self.layers]  # the list the model is given
        self.attention = [new.get(id(layer), layer) for layer in self.attention]

    def prepare(self, lengths: Sequence[int], width: int, layouts: Optional[Sequence] = None):
        """Before a ``width``-wide pass in which row b feeds ``lengths[b]`` real tokens;
        ``layouts``: each row's ``decoder.tree.layout`` in a pass with a draft tree."""
        self.until_quantized()
        if self.recurrent and min(lengths) < width:
            for layer in self.recurrent:
                layer.prepare(lengths=list(lengths))
        if layouts is not None:
            depth = mx.array([depth for depth, _ in layouts], mx.int32)
            visible = mx.array([visible for _, visible in layouts], mx.bool_)
            for layer in self.attention:
                layer.begin_tree(depth, visible)
        self.in_tree = layouts is not None

    def finalize(self):
        for layer in self.recurrent:
            layer.finalize()
        if self.in_tree:
            for layer in self.attention:
                layer.end_tree()
            self.in_tree = False

    def takes_trees(self) -> bool:
        """Whether every layer can take a draft tree: attention layers and a head's features,
        which ``KVRows.compact`` moves alike (a recurrent state folds every token it is fed into
        one, and a chunked layer keeps one row)."""
        return all(isinstance(layer, KVRows) for layer in layers_of(self.layers))

    def compact(self, width: int, kept: Sequence[Optional[Sequence[int]]]):
        """After a tree pass ``width`` slots wide, each row's ``kept`` slots move to the front of
        the pass (``KVRows.compact``); ``rewind`` then drops the rest."""
        if any(slots is not None for slots in kept):
            for layer in self.attention + self.extra:
                layer.compact(width, kept)

    def must_restore(self, num_drafted: int, num_accepted: int) -> bool:
        """Whether a row that rejected part of its draft goes back to the checkpoint: a recurrent
        state cannot drop tokens, so its accepted ones are fed again."""
        return bool(self.recurrent) and num_accepted < num_drafted

    def checkpoint(self):
        """Keep the recurrent layers' states as they are now, before a pass with a draft."""
        for layer in self.recurrent:
            layer.checkpoint()

    def rewind(self, trims: Sequence[int], restored: Sequence[int] = ()):
        """Row b drops the last ``trims[b]`` tokens it holds (raises where it cannot), and the rows
        in ``restored`` go back to their recurrent states at the checkpoint."""
        if any(trims):
            for layer in self.attention:
                layer.trim_rows(trims)
            for layer in self.extra:
                layer.rewind(trims)
        if restored:
            for layer in self.recurrent:
                layer.restore(restored)

    def filter(self, keep: Sequence[int]):
        for layer in self.layers:
            layer.filter(list(keep))
        self.rows = len(keep)

    def extend(self, other: "Cache"):
        for layer, new_layer in zip(self.layers, other.layers):
            layer.extend(new_layer)
        self.rows += other.rows

    def realign(self):
        for layer in self.attention + self.extra:
            layer.realign()

    def extract(self, row: int, length: int, since: int = 0) -> CachedPrefix:
        """Row ``row``'s cache, which holds the first ``length`` tokens of its text (a copy; of
        the attention layers' positions from ``since`` on)."""
        attention = [layer.extract(row, since) for layer in self.attention]
        shortest = max(
            [
                first + layer.window - 1
                for layer, (_, _, first) in zip(self.attention, attention)
                if first > since
            ]
            + [0]
        )
        states = [layer.extract(row) for layer in self.recurrent]
        extra = tuple(layer.extract(row, since) for layer in self.extra)
        return CachedPrefix(length, attention, states, shortest, extra)

    def fill(self, prefixes: Sequence[Optional[CachedPrefix]]):
        """An empty cache whose row b holds ``prefixes[b]`` (None: nothing)."""
        for row, prefix in enumerate(prefixes):
            quantized = prefix is not None and any(
                isinstance(k, tuple) for k, *_ in prefix.attention
            )
            if quantized and self.quantize_at is not None:  # stored past quantized_kv_start
                self._quantize()
            if prefix is not None:
                for layer, entry in zip(self.attention, prefix.attention):
                    layer.fill(row, *entry)
                for layer, states in zip(self.recurrent, prefix.states):
                    layer.fill(row, states)
                for layer, entry in zip(self.extra, prefix.extra):
                    if entry is not None:
                        layer.fill(row, *entry)


def _adopted(layer):
    """``layer`` of a one-row mlx-lm cache in its kind here, holding the same tokens."""
    if isinstance(layer, (KVRows, StateRows, ChunkedRows)):
        return layer
    if isinstance(layer, CacheList):
        return CacheList(*(_adopted(child) for child in layer.caches))
    if type(layer) is ChunkedKVCache:
        return ChunkedRows.from_state(layer.state)
    if isinstance(layer, RotatingKVCache) and not layer.empty():
        raise CacheKindError(
            "a RotatingKVCache that already holds tokens cannot be rolled back; "
            "build the prompt cache with cache.make_cache(model)"
        )
    adopted = _kind(layer, 1, None, 4)
    if type(layer) is KVCache and layer.keys is not None:
        adopted.fill(0, layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :], 0)
    elif type(layer) is ArraysCache:
        adopted.cache = list(layer.cache)
    return adopted


def adopt(cache) -> Cache:
    """A ``Cache`` of one row from a ``Cache`` or an mlx-lm list of layer caches, whose entries are
    replaced in place by their kinds here (so the list can be passed again)."""
    if isinstance(cache, Cache):
        return cache
    try:
        cache[:] = [_adopted(layer) for layer in cache]
    except CacheKindError as error:
        raise CacheKindError(f"a prompt cache: {error}") from None
    return Cache(cache, 1)


def make_cache(
    model,
    rows: int = 1,
    max_rollback: Optional[int] = None,
    mask_dims: int = 4,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
) -> Cache:
    """The model's cache for ``rows`` rows that roll back alone (else ``CacheKindError``);
    ``kv_bits`` (4 or 8): attention layers keep their keys and values quantized, ``kv_group_size``
    values per scale (recurrent states stay as they are), once one row holds
    ``quantized_kv_start`` tokens (``Cache.until_quantized``; a batch quantizes from 0)."""
    quantized = None if kv_bits is None else (kv_bits, kv_group_size, quantized_kv_start)
    return Cache.of(model, rows, max_rollback, mask_dims, quantized)


# Architectures whose attention cannot run on a quantized cache, and why (found by
# ``check_quantizable``'s probe on tiny models of each).
_SINKS = "its attention sinks: mlx-lm's quantized attention has none"
_OWN = "its attention reads the cached keys itself, not through mlx-lm's quantized kernel"
UNQUANTIZABLE = {
    "gpt_oss": _SINKS,
    "deepseek_v41": _SINKS,
    "mimo_v2_flash": _SINKS,
    "deepseek_v3": _OWN,  # latent attention (MLA)
    "kimi_linear": _OWN,
    "bailing_moe_v3": _OWN,
    "gemma2": _OWN,  # soft-capped scores
    "gemma4_text": _OWN,
}


def check_quantizable(model, group_size: Optional[int] = None):
    """Refuse in one line a model whose attention the quantized kernel cannot run; with
    ``group_size``, one whose keys or values (in a one-token pass) are not a multiple of it wide."""
    name, why = architecture(model), UNQUANTIZABLE.get(architecture(model))
    if why is not None:
        raise CacheKindError(f"{name}: its cache cannot be quantized ({why})")
    if group_size is None:
        return
    token, probe = mx.array([[0]], mx.int32), Cache.of(model)
    model(token, cache=probe.layers)
    layers = [layer for layer in probe.attention if isinstance(layer, KVRows)]
    widths = {part.shape[-1] for layer in layers for part in (layer.keys, layer.values)}
    if any(width % group_size for width in widths):
        fits = [size for size in (32, 64, 128) if all(width % size == 0 for width in widths)]
        raise CacheKindError(
            f"{name}: its keys and values are {sorted(widths)} wide, which groups of "
            f"{group_size} do not divide ("
            + (f"--kv-group-size {fits[-1]} does)" if fits else "no group size does)")
        )
    try:  # a model whose attention code reads the cache itself fails here, not mid-request
        model(token, cache=Cache.of(model, quantized=(8, group_size, 0)).layers)
    except Exception as error:
        raise CacheKindError(
            f"{name}: its attention does not run on a quantized cache "
            f"({type(error).__name__}: {str(error).splitlines()[0]})"
        ) from None
