"""A model's cache for 1 to B rows that each roll back alone, for every kind of layer mlx-lm builds.

A verify pass writes ``pending + draft`` into the cache and each row keeps a prefix of its draft.
One class per kind of layer, as in mlx-lm's ``models/cache.py``; one row is the batch at B = 1:

- ``KVRows``, attention (``KVCache``, latent attention too) and sliding windows (``RotatingKVCache``):
  row b holds its tokens in slots ``[start_b, end_b)`` of one ``[B, heads, slots, dim]`` buffer, so a
  row drops its rejected tail by moving its end (vLLM's rule: the next pass writes over it). Slots
  outside a row are masked, never zeroed (a zero key still adds e^0 to a softmax). A sliding layer
  keeps each row's window plus ``max_rollback`` positions and drops older slots a block at a time;
  mlx-lm's ``RotatingKVCache`` writes over its oldest slot once full and cannot roll back.
- ``StateRows``, recurrent layers (``ArraysCache``: conv and SSM states, gated delta) hold one state per
  row, not an entry per token: ``checkpoint`` keeps the states from before a pass (references, no copy:
  the layers replace their arrays rather than write into them) and ``restore`` puts rows back to
  them after a rejection; the row's accepted tokens are then fed again at the front of its next pass.
- ``ChunkedRows``, attention in chunks (``ChunkedKVCache``): one row only, since the model builds its
  chunk mask from one scalar offset.

    cache = make_cache(model)              # Cache: its layers are what the model is called with
    cache.checkpoint()                     # before a pass with a draft
    logits = model(inputs, cache=cache.layers)
    cache.rewind(trims=[3], restored=[])   # row 0 drops the pass's last 3 tokens (checked)
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache, _BaseCache, \
    dynamic_roll, make_prompt_cache


class CacheKindError(ValueError):
    """A layer cache that drafts cannot be rolled back in (the message names it)."""


def architecture(model) -> str:
    """The model's ``model_type`` (mlx-lm's name for its architecture), to name it in a refusal."""
    return getattr(getattr(model, "args", None), "model_type", None) or type(model).__name__


class KVRows(_BaseCache):
    """Keys and values of one attention layer for ``B`` rows, each with its own length.

    Per row (host ints): ``starts``/``ends``, the slots it holds, and ``origins``, the slot its position 0
    would have, so a row's RoPE position is ``end - origin`` and ``start - origin`` positions were dropped.

    Args:
        rows: how many rows (empty).
        window: a sliding-window layer's window; None for full attention.
        max_rollback: how far back a sliding row can go across calls (a pass is always undone whole).
        mask_dims: 4 for ``(B, 1, N, S)`` masks; 5 for ``(B, 1, 1, N, S)`` (gemma2's grouped scores).
    """

    step = 256  # slots a full-attention layer grows by
    window_step = 64  # slots a sliding layer grows and drops by: it holds at most window + max_rollback + this
    max_rollback = 32  # the default: more than a draft's one-token calls span

    def __init__(self, rows: int, window: Optional[int] = None, max_rollback: Optional[int] = None,
                 mask_dims: int = 4):
        self.keys = self.values = None
        self.window, self.mask_dims = window, mask_dims
        if max_rollback is not None:
            self.max_rollback = max_rollback
        self._set([0] * rows, [0] * rows, [0] * rows)

    def _set(self, starts: List[int], ends: List[int], origins: List[int]):
        self.starts, self.ends, self.origins = starts, ends, origins
        # RoPE reads the offset: an int for one row (as mlx-lm's KVCache), else one per row.
        positions = [end - origin for end, origin in zip(ends, origins)]
        self.offset = positions[0] if len(ends) == 1 else mx.array(positions)

    @property
    def rows(self) -> int:
        return len(self.ends)

    def _first_seen(self) -> int:
        """The first slot a query of the next call can see (before that call drops anything)."""
        if self.window is None:
            return min(self.starts)
        return min(max(start, end - self.window + 1) for start, end in zip(self.starts, self.ends))

    def _make_room(self, num_new: int, keys: mx.array, values: mx.array):
        """A new buffer with room for ``num_new`` more slots, without the slots no row needs any more."""
        top = max(self.ends)
        drop = min(self.starts)
        if self.window is not None:  # a sliding row needs its window and the rollback slack
            reach = self.window + self.max_rollback - 1
            drop = min(max(start, end - reach) for start, end in zip(self.starts, self.ends))
        step = self.step if self.window is None else self.window_step
        size = (top - drop + num_new + step - 1) // step * step
        new_keys = mx.zeros((self.rows, keys.shape[1], size, keys.shape[3]), keys.dtype)
        new_values = mx.zeros((self.rows, values.shape[1], size, values.shape[3]), values.dtype)
        if self.keys is not None and top > drop:
            new_keys[..., : top - drop, :] = self.keys[..., drop:top, :]
            new_values[..., : top - drop, :] = self.values[..., drop:top, :]
        self.keys, self.values = new_keys, new_values
        self._set([max(s - drop, 0) for s in self.starts], [e - drop for e in self.ends],
                  [o - drop for o in self.origins])
        return drop

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        first, num_new = self._first_seen(), keys.shape[2]
        if self.keys is None or max(self.ends) + num_new > self.keys.shape[2]:
            first -= self._make_room(num_new, keys, values)
        if len(set(self.ends)) == 1:  # every row writes the same slots: an in-place slice update
            end = self.ends[0]
            self.keys[..., end : end + num_new, :] = keys
            self.values[..., end : end + num_new, :] = values
        else:
            slots = (mx.array(self.ends)[:, None] + mx.arange(num_new))[:, None, :, None]
            self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(slots, keys.shape), keys, axis=2)
            self.values = mx.put_along_axis(self.values, mx.broadcast_to(slots, values.shape), values, axis=2)
        self._set(self.starts, [end + num_new for end in self.ends], self.origins)
        top = max(self.ends)
        return self.keys[..., first:top, :], self.values[..., first:top, :]

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kwargs):
        """Query q of row b sees its slots up to its own, within its window; keys start at ``_first_seen``."""
        # A query never sees more than the cache's window, however wide a window the model asks for
        # (plamo3 asks for one more): a verify pass must see what one-token steps see.
        window = min(window_size or self.window, self.window) if self.window else window_size
        first = self._first_seen()
        same = len(set(self.ends)) == 1 and len(set(self.starts)) == 1
        if same and not return_array and (window is None or N == 1 and window == self.window):
            if window is None and self.starts[0] == first:
                return None if N == 1 else "causal"
            if N == 1 and self.ends[0] - first <= window:
                return None  # one query sees every key it is given
        slots = mx.arange(first, max(self.ends) + N)
        own = mx.array(self.ends)[:, None, None] + mx.arange(N)[None, :, None]  # each query's own slot
        seen = (slots >= mx.array(self.starts)[:, None, None]) & (slots <= own)
        if window is not None:  # a row's slots are contiguous: slot distance is position distance
            seen = seen & (slots > own - window)
        # A padding query sees only itself: a query that sees nothing would turn into NaN, and the
        # next layer's keys and values with it (0 * NaN is NaN even where the mask hides them).
        mask = (seen | (slots == own))[:, None]
        return mask[:, None] if self.mask_dims == 5 else mask

    def can_trim(self, row: int) -> int:
        """How many of row ``row``'s last tokens it can drop and still hold every key its next query sees."""
        held = self.ends[row] - self.starts[row]
        if self.window is None or self.starts[row] == self.origins[row]:  # nothing dropped yet
            return held
        return max(held - self.window + 1, 0)

    def trim_rows(self, counts: Sequence[int]):
        """Drop the last ``counts[b]`` tokens of each row b; raises if a row cannot drop that many."""
        for row, count in enumerate(counts):
            if count > self.can_trim(row):  # a count that says less was done is never ignored
                raise RuntimeError(f"row {row} of a {self.window or 'full'}-window attention layer cannot drop "
                                   f"its last {count} tokens (it holds {self.ends[row] - self.starts[row]})")
        self._set(self.starts, [end - count for end, count in zip(self.ends, counts)], self.origins)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """mlx-lm's ``trim``: every row drops up to ``n`` tokens; returns how many."""
        n = min([n] + [self.can_trim(row) for row in range(self.rows)])
        self.trim_rows([n] * self.rows)
        return n

    def filter(self, keep: Sequence[int]):
        """Keep rows ``keep`` (in that order) and drop the slots no kept row uses."""
        starts, ends, origins = ([values[i] for i in keep] for values in (self.starts, self.ends, self.origins))
        shift = min(starts, default=0)
        if self.keys is not None:
            rows = mx.array(list(keep), mx.int32)
            self.keys, self.values = self.keys[rows, :, shift:], self.values[rows, :, shift:]
        self._set([s - shift for s in starts], [e - shift for e in ends], [o - shift for o in origins])

    def extend(self, other: "KVRows"):
        """Append ``other``'s rows, right-aligned with these so no row attends over the other's past."""
        top = max(self.ends + other.ends, default=0)
        shifts = [top - max(cache.ends, default=0) for cache in (self, other)]
        moved = [[[v + shift for v in values] for values in (cache.starts, cache.ends, cache.origins)]
                 for cache, shift in zip((self, other), shifts)]
        filled = [cache for cache in (self, other) if cache.keys is not None]
        if filled:
            size = max(c.keys.shape[2] + shift for c, shift in zip((self, other), shifts) if c.keys is not None)
            _, heads, _, key_dim = filled[0].keys.shape
            value_dim, dtype = filled[0].values.shape[3], filled[0].keys.dtype
            keys, values = [], []
            for cache, shift in zip((self, other), shifts):
                if cache.keys is None:  # rows with nothing cached yet
                    keys.append(mx.zeros((cache.rows, heads, size, key_dim), dtype))
                    values.append(mx.zeros((cache.rows, heads, size, value_dim), dtype))
                else:
                    pad = [(0, 0), (0, 0), (shift, size - shift - cache.keys.shape[2]), (0, 0)]
                    keys.append(mx.pad(cache.keys, pad))
                    values.append(mx.pad(cache.values, pad))
            self.keys, self.values = mx.concatenate(keys), mx.concatenate(values)
        self._set(*(mine + theirs for mine, theirs in zip(*moved)))

    def realign(self):
        """Roll each row right so that all rows end at the same slot (a copy of the cache)."""
        top = max(self.ends)
        shifts = [top - end for end in self.ends]
        if self.keys is not None and any(shifts):
            shift = mx.array(shifts)[:, None]
            self.keys = dynamic_roll(self.keys, shift, axis=2)
            self.values = dynamic_roll(self.values, shift, axis=2)
        self._set(*([v + d for v, d in zip(values, shifts)] for values in (self.starts, self.ends, self.origins)))

    def extract(self, row: int) -> tuple:
        """Row ``row``'s ``(keys, values, first position held)``, ``[1, heads, n, dim]`` each (a copy)."""
        start, end = self.starts[row], self.ends[row]
        return (mx.contiguous(self.keys[row : row + 1, :, start:end]),
                mx.contiguous(self.values[row : row + 1, :, start:end]), start - self.origins[row])

    def fill(self, row: int, keys: mx.array, values: mx.array, first: int):
        """Row ``row`` of an empty cache holds ``keys``/``values`` of positions ``[first, first + n)``."""
        n = keys.shape[2]
        if self.keys is None or n > self.keys.shape[2]:
            self._make_room(n, keys, values)
        self.keys[row : row + 1, :, :n] = keys
        self.values[row : row + 1, :, :n] = values
        starts, ends, origins = list(self.starts), list(self.ends), list(self.origins)
        starts[row], ends[row], origins[row] = 0, n, -first
        self._set(starts, ends, origins)

    @property
    def state(self):
        return self.keys, self.values, self.offset

    def size(self) -> int:
        return max(self.ends, default=0)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class StateRows(ArraysCache):
    """A recurrent layer's states for ``rows`` rows (mlx-lm's ``ArraysCache``: rows shorter than a pass
    are kept out of it through ``prepare(lengths=...)``), that can put rows back to a checkpoint."""

    def __init__(self, size: int, rows: int):
        super().__init__(size)
        self.rows, self.saved = rows, None

    @property
    def batch_size(self) -> int:  # known even before the first pass makes the states
        return self.rows

    def filter(self, keep: Sequence[int]):
        super().filter(mx.array(list(keep)))
        self.rows = len(keep)

    def extend(self, other: "StateRows"):
        super().extend(other)
        self.rows += other.rows

    def checkpoint(self):
        self.saved = list(self.cache)  # references: the layers assign new arrays, never write into these

    def restore(self, rows: Sequence[int]):
        """Put ``rows`` back to their states at the last ``checkpoint``."""
        if len(rows) == self.rows:  # every row: the saved arrays themselves
            self.cache = list(self.saved)
            return
        index = mx.array(list(rows))
        for state, saved in zip(self.cache, self.saved):
            if state is not None:  # a state first made in the pass started from zeros
                state[index] = 0 if saved is None else saved[index]

    def extract(self, row: int) -> list:
        return [mx.contiguous(state[row : row + 1]) for state in self.cache if state is not None]

    def fill(self, row: int, states: list):
        """Row ``row`` of these states starts from ``states`` (``extract``'s, of one row)."""
        if self.cache[0] is None:
            self.cache = [mx.zeros((self.rows, *state.shape[1:]), state.dtype) for state in states]
        for state, row_state in zip(self.cache, states):
            state[row : row + 1] = row_state


class ChunkedRows(ChunkedKVCache):
    """mlx-lm's ``ChunkedKVCache`` for one row, with the checked rollback of ``KVRows``. One row only:
    llama4 builds its chunk mask from the first layer's scalar offset and ``start_position``."""

    rows = 1

    def can_trim(self, row: int = 0) -> int:
        return self.offset - self.start_position

    def trim_rows(self, counts: Sequence[int]):
        if self.trim(counts[0]) != counts[0]:
            raise RuntimeError(f"a chunked attention layer cannot drop its last {counts[0]} tokens")


def _kind(layer, rows: int, max_rollback: Optional[int], mask_dims: int):
    """The form of one ``make_prompt_cache`` layer here: mlx-lm's kinds, told apart by class (a renaming table)."""
    if isinstance(layer, CacheList):
        return CacheList(*(_kind(child, rows, max_rollback, mask_dims) for child in layer.caches))
    if isinstance(layer, RotatingKVCache):
        if layer.keep:
            raise CacheKindError(f"a sliding-window cache that always keeps its first {layer.keep} tokens "
                                 "cannot be rolled back yet")
        return KVRows(rows, layer.max_size, max_rollback, mask_dims)
    if type(layer) is KVCache:
        return KVRows(rows, mask_dims=mask_dims)
    if type(layer) is ArraysCache:
        return StateRows(len(layer.cache), rows)
    if type(layer) is ChunkedKVCache and rows == 1:
        return ChunkedRows(layer.chunk_size)
    what = "be batched" if rows > 1 and type(layer) is ChunkedKVCache else "be rolled back"
    raise CacheKindError(f"its {type(layer).__name__} layers cannot {what}")


def layers_of(cache: list) -> list:
    """Every layer cache, with the children of a ``CacheList`` in its place."""
    return [leaf for layer in cache for leaf in (layers_of(layer.caches) if isinstance(layer, CacheList) else [layer])]


@dataclass(frozen=True)
class CachedPrefix:
    """One row's cache for the first ``length`` tokens of its text, for a later prompt that extends
    them (a conversation's next turn): each attention layer's ``(keys, values, first)`` of positions
    ``[first, length)`` (a sliding layer may have dropped the ones before), and each recurrent layer's
    states after exactly those tokens. A state holds no shorter prefix, so only a prompt that extends
    all ``length`` tokens can use a prefix with states."""

    length: int
    attention: list  # per attention layer (keys, values, first), keys and values [1, heads, length - first, dim]
    states: list  # per recurrent layer, its state arrays, each [1, ...]; empty without recurrent layers
    shortest: int = 0  # the shortest length it can be cut to (sliding layers need their window's keys)

    def usable(self, common: int) -> int:
        """The longest prefix of at most ``common`` tokens it can serve; 0 for none."""
        if self.states:
            return self.length if common >= self.length else 0
        return min(common, self.length) if common >= self.shortest else 0

    def cut(self, length: int) -> "CachedPrefix":
        """The entries of the first ``length`` tokens (``usable`` says which lengths it has)."""
        if length == self.length:
            return self
        return CachedPrefix(length, [(keys[:, :, : length - first], values[:, :, : length - first], first)
                                     for keys, values, first in self.attention], [], self.shortest)

    def arrays(self) -> list:
        return [array for keys, values, _ in self.attention for array in (keys, values)] + \
               [array for layer in self.states for array in layer]


class Cache:
    """A model's cache for ``rows`` rows: ``layers`` (what the model is called with, one per layer in
    the kind of ``_kind``'s table) and the operations on rows, applied to every layer at once.

    Args:
        max_rollback: how many tokens a row may drop across calls (a draft model's one-token drafts);
            a pass is always undone whole.
        mask_dims: see ``KVRows`` (``batch.cache.probe`` finds it).
    """

    def __init__(self, layers: list, rows: int):
        self.layers, self.rows = layers, rows
        leaves = layers_of(layers)
        self.attention = [layer for layer in leaves if layer.is_trimmable()]
        self.recurrent = [layer for layer in leaves if isinstance(layer, StateRows)]

    @classmethod
    def of(cls, model, rows: int = 1, max_rollback: Optional[int] = None, mask_dims: int = 4) -> "Cache":
        try:
            return cls([_kind(layer, rows, max_rollback, mask_dims) for layer in make_prompt_cache(model)], rows)
        except CacheKindError as error:
            raise CacheKindError(f"{architecture(model)}: {error}") from None

    def held(self, row: int = 0) -> Optional[int]:
        """How many tokens row ``row`` holds (None for a model of recurrent layers only: no layer counts)."""
        if not self.attention:
            return None
        layer = self.attention[0]
        return layer.offset if isinstance(layer, ChunkedRows) else layer.ends[row] - layer.origins[row]

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
        return [array for layer in self.attention if layer.keys is not None for array in (layer.keys, layer.values)] \
            + states

    def prepare(self, lengths: Sequence[int], width: int):
        """Before a ``width``-wide pass in which row b feeds ``lengths[b]`` real tokens."""
        if self.recurrent and min(lengths) < width:
            for layer in self.recurrent:
                layer.prepare(lengths=list(lengths))

    def finalize(self):
        for layer in self.recurrent:
            layer.finalize()

    def checkpoint(self):
        """Keep the recurrent layers' states as they are now, before a pass with a draft."""
        for layer in self.recurrent:
            layer.checkpoint()

    def rewind(self, trims: Sequence[int], restored: Sequence[int] = ()):
        """Row b drops the last ``trims[b]`` tokens it holds (raises where it cannot), and the rows in
        ``restored`` go back to their recurrent states at the checkpoint."""
        if any(trims):
            for layer in self.attention:
                layer.trim_rows(trims)
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
        for layer in self.attention:
            layer.realign()

    def extract(self, row: int, length: int) -> CachedPrefix:
        """Row ``row``'s cache, which holds the first ``length`` tokens of its text (a copy)."""
        attention = [layer.extract(row) for layer in self.attention]
        shortest = max([first + layer.window - 1 for layer, (_, _, first) in zip(self.attention, attention)
                        if first > 0] + [0])
        return CachedPrefix(length, attention, [layer.extract(row) for layer in self.recurrent], shortest)

    def fill(self, prefixes: Sequence[Optional[CachedPrefix]]):
        """An empty cache whose row b holds ``prefixes[b]`` (None: nothing)."""
        for row, prefix in enumerate(prefixes):
            if prefix is not None:
                for layer, entry in zip(self.attention, prefix.attention):
                    layer.fill(row, *entry)
                for layer, states in zip(self.recurrent, prefix.states):
                    layer.fill(row, states)


def _adopted(layer):
    """``layer`` of a one-row mlx-lm cache in its kind here, holding the same tokens."""
    if isinstance(layer, (KVRows, StateRows, ChunkedRows)):
        return layer
    if isinstance(layer, CacheList):
        return CacheList(*(_adopted(child) for child in layer.caches))
    if type(layer) is ChunkedKVCache:
        return ChunkedRows.from_state(layer.state)
    if isinstance(layer, RotatingKVCache) and not layer.empty():
        raise CacheKindError("a RotatingKVCache that already holds tokens cannot be rolled back; "
                             "build the prompt cache with cache.make_cache(model)")
    adopted = _kind(layer, 1, None, 4)
    if type(layer) is KVCache and layer.keys is not None:
        adopted.fill(0, layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :], 0)
    elif type(layer) is ArraysCache:
        adopted.cache = list(layer.cache)
    return adopted


def adopt(cache) -> Cache:
    """A ``Cache`` of one row from ``cache``: a ``Cache`` as it is, or a list of mlx-lm layer caches
    (``make_prompt_cache``, perhaps holding tokens), whose entries are replaced in place by their
    kinds here, so the caller's list can be passed again."""
    if isinstance(cache, Cache):
        return cache
    try:
        cache[:] = [_adopted(layer) for layer in cache]
    except CacheKindError as error:
        raise CacheKindError(f"a prompt cache: {error}") from None
    return Cache(cache, 1)


def make_cache(model, rows: int = 1, max_rollback: Optional[int] = None, mask_dims: int = 4) -> Cache:
    """The model's cache (``make_prompt_cache``) for ``rows`` rows, every layer in a kind that rolls
    back per row; ``CacheKindError`` naming the architecture and the layer kind otherwise."""
    return Cache.of(model, rows, max_rollback, mask_dims)
