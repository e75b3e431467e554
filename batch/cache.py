"""One cache for a batch whose rows each keep their own length, so each row rolls back alone.

A verification pass writes ``[B, W]`` tokens, and row ``b`` keeps only some of them. mlx-lm's batch
caches keep one write index for all rows, so a row that keeps fewer tokens than another must be
rolled (a copy of the whole cache per step). Here every row has its own end instead (vLLM's rule:
rejected slots are simply written over by the next step):

    row b holds its tokens in slots [start_b, end_b); its RoPE position is end_b - start_b
    a pass of N tokens writes row b's at [end_b, end_b + N)   (one scatter, or a slice when aligned)
    trim_rows(counts) moves each end back by its own count

Slots outside a row's ``[start, end)`` (alignment padding, rejected tails) are masked, never zeroed:
a zero key still adds e^0 to a softmax. Sliding-window layers keep every slot and mask each query to
its window. Recurrent layers (``RecurrentRows``) hold one state per row: rows shorter than the pass
are kept out of it by mlx-lm's ``lengths`` mask, and a row whose draft was rejected goes back to its
state from before the pass (``checkpoint``/``restore``), as ``rollback.Rollback`` does for one row.

Prompts are right-padded, never left-padded: every written token then has a position >= 0 (a model
may scale by its position: ministral3's log(1 + floor(pos / n)) is -inf below 0, and the NaN it makes
in a padded slot's values spreads to every row through 0 * NaN).

Rows drift apart as they accept different numbers of tokens, so every row attends over the
longest one's slots; ``realign`` (a roll, run rarely) packs them right again.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache, _BaseCache, dynamic_roll, \
    make_prompt_cache

from rollback import CacheKindError, architecture, layers_of


class RaggedKVCache(_BaseCache):
    """A per-layer cache of ``B`` rows, each with its own start and end slot (host ints).

    Args:
        starts, ends: each row's first slot and one past its last (default: empty rows at 0).
        window: a sliding-window layer's window (queries see at most this many positions back).
        mask_dims: 4 for ``(B, 1, N, S)`` masks; 5 for ``(B, 1, 1, N, S)``, for models whose attention
            groups query heads in a dimension of their own (gemma2), see ``probe``.
    """

    step = 256

    def __init__(self, starts: Sequence[int], ends: Optional[Sequence[int]] = None, window: Optional[int] = None,
                 mask_dims: int = 4):
        self.keys = self.values = None
        self.window, self.mask_dims = window, mask_dims
        self._set(list(starts), list(starts) if ends is None else list(ends))

    def _set(self, starts: List[int], ends: List[int]):
        # Host copies decide shapes and fast paths; device copies feed RoPE, the scatter and the mask.
        self.starts, self.ends = starts, ends
        self.offset = mx.array([end - start for start, end in zip(starts, ends)])
        self._starts, self._ends = mx.array(starts), mx.array(ends)

    def aligned(self) -> bool:
        return len(set(self.ends)) <= 1

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        num_new = keys.shape[2]
        top = max(self.ends) + num_new
        if self.keys is None or top > self.keys.shape[2]:
            self._grow(top, keys, values)
        if self.aligned():  # every row writes the same slots: an in-place slice update
            end = self.ends[0]
            self.keys[..., end : end + num_new, :] = keys
            self.values[..., end : end + num_new, :] = values
        else:
            slots = (self._ends[:, None] + mx.arange(num_new))[:, None, :, None]
            self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(slots, keys.shape), keys, axis=2)
            self.values = mx.put_along_axis(self.values, mx.broadcast_to(slots, values.shape), values, axis=2)
        self.ends = [end + num_new for end in self.ends]
        self._ends = self._ends + num_new
        self.offset = self.offset + num_new
        return self.keys[..., :top, :], self.values[..., :top, :]

    def _grow(self, top: int, keys: mx.array, values: mx.array):
        size = (top + self.step - 1) // self.step * self.step
        batch, heads, _, key_dim = keys.shape
        new_keys = mx.zeros((batch, heads, size, key_dim), keys.dtype)
        new_values = mx.zeros((batch, heads, size, values.shape[3]), values.dtype)
        if self.keys is not None:
            used = max(self.ends)
            new_keys[..., :used, :] = self.keys[..., :used, :]
            new_values[..., :used, :] = self.values[..., :used, :]
        self.keys, self.values = new_keys, new_values

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kwargs):
        """Query q of row b sees slots [start_b, end_b + q] (and its own), within its window."""
        # A sliding layer's query never sees more than its window, as rollback.SlidingKVCache's.
        window = min(window_size or self.window, self.window) if self.window else window_size
        if window is None and self.aligned() and not any(self.starts) and not return_array:
            return None if N == 1 else "causal"  # plain causal attention
        slots = mx.arange(max(self.ends) + N)
        own = self._ends[:, None, None] + mx.arange(N)[None, :, None]  # each query's own slot
        seen = (slots >= self._starts[:, None, None]) & (slots <= own)
        if window is not None:  # a row's slots are contiguous: slot distance is position distance
            seen = seen & (slots > own - window)
        # A padding query sees only itself: a query that sees nothing would turn into NaN, and the
        # next layer's keys and values with it (0 * NaN is NaN even where the mask hides them).
        mask = (seen | (slots == own))[:, None]
        return mask[:, None] if self.mask_dims == 5 else mask

    def trim_rows(self, counts: Sequence[int], device_counts: Optional[mx.array] = None):
        """Drop the last ``counts[b]`` tokens of each row b (the rejected part of a pass)."""
        self.ends = [end - count for end, count in zip(self.ends, counts)]
        counts = mx.array(counts) if device_counts is None else device_counts
        self._ends = self._ends - counts
        self.offset = self.offset - counts

    def trim(self, n: int) -> int:
        n = min(n, min(end - start for start, end in zip(self.starts, self.ends)))
        self.trim_rows([n] * len(self.ends))
        return n

    def is_trimmable(self) -> bool:
        return True

    def filter(self, keep: Sequence[int]):
        """Keep rows ``keep`` (in that order) and drop the slots no kept row uses."""
        starts = [self.starts[i] for i in keep]
        ends = [self.ends[i] for i in keep]
        shift = min(starts, default=0)
        if self.keys is not None:
            rows = mx.array(list(keep), mx.int32)
            self.keys, self.values = self.keys[rows, :, shift:], self.values[rows, :, shift:]
        self._set([s - shift for s in starts], [e - shift for e in ends])

    def extend(self, other: "RaggedKVCache"):
        """Append ``other``'s rows, right-aligned with these so no row attends over the other's past."""
        top = max(self.ends + other.ends, default=0)
        shifts = [top - max(cache.ends, default=0) for cache in (self, other)]
        starts = [s + shifts[0] for s in self.starts] + [s + shifts[1] for s in other.starts]
        ends = [e + shifts[0] for e in self.ends] + [e + shifts[1] for e in other.ends]
        filled = [cache for cache in (self, other) if cache.keys is not None]
        if filled:
            size = max(c.keys.shape[2] + shift for c, shift in zip((self, other), shifts) if c.keys is not None)
            _, heads, _, key_dim = filled[0].keys.shape
            value_dim, dtype = filled[0].values.shape[3], filled[0].keys.dtype
            keys, values = [], []
            for cache, shift in zip((self, other), shifts):
                if cache.keys is None:  # rows with nothing cached yet
                    keys.append(mx.zeros((len(cache.ends), heads, size, key_dim), dtype))
                    values.append(mx.zeros((len(cache.ends), heads, size, value_dim), dtype))
                else:
                    pad = [(0, 0), (0, 0), (shift, size - shift - cache.keys.shape[2]), (0, 0)]
                    keys.append(mx.pad(cache.keys, pad))
                    values.append(mx.pad(cache.values, pad))
            self.keys, self.values = mx.concatenate(keys), mx.concatenate(values)
        self._set(starts, ends)

    def realign(self):
        """Roll each row right so that all rows end at the same slot (a copy of the cache)."""
        top = max(self.ends)
        shifts = [top - end for end in self.ends]
        if self.keys is not None and any(shifts):
            shift = mx.array(shifts)[:, None]
            self.keys = dynamic_roll(self.keys, shift, axis=2)
            self.values = dynamic_roll(self.values, shift, axis=2)
        self._set([s + d for s, d in zip(self.starts, shifts)], [top] * len(self.ends))

    def row_entries(self, row: int) -> tuple:
        """Row ``row``'s keys and values, ``[1, heads, n, dim]`` each (a copy)."""
        start, end = self.starts[row], self.ends[row]
        return (mx.contiguous(self.keys[row : row + 1, :, start:end]),
                mx.contiguous(self.values[row : row + 1, :, start:end]))

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


@dataclass(frozen=True)
class CachedPrefix:
    """A finished row's cache for the first ``length`` tokens of its text, for a later prompt that
    extends them (a conversation's next turn): each attention layer's keys and values, and each
    recurrent layer's states after exactly those tokens. A state holds no shorter prefix, so only a
    prompt that extends all ``length`` tokens can use a prefix with states."""

    length: int
    attention: list  # per attention layer (keys, values), each [1, heads, length, dim]
    states: list  # per recurrent layer, its state arrays, each [1, ...]; empty without recurrent layers

    def cut(self, length: int) -> Optional["CachedPrefix"]:
        """The entries of the first ``length`` tokens; None where a state cannot be cut that short."""
        if length == self.length:
            return self
        if self.states:
            return None
        return CachedPrefix(length, [(keys[:, :, :length], values[:, :, :length]) for keys, values in self.attention], [])

    def arrays(self) -> list:
        return [array for pair in self.attention for array in pair] + [array for layer in self.states for array in layer]


class RecurrentRows(ArraysCache):
    """A recurrent layer's states for a batch of ``rows`` (mlx-lm's ``ArraysCache``: rows shorter than a
    pass are masked out of it through ``prepare(lengths=...)``), that can put rows back to a checkpoint."""

    def __init__(self, size: int, rows: int):
        super().__init__(size)
        self.rows, self.saved = rows, None

    @property
    def batch_size(self) -> int:  # known even before the first pass makes the states
        return self.rows

    def filter(self, keep: Sequence[int]):
        super().filter(mx.array(list(keep)))
        self.rows = len(keep)

    def extend(self, other: "RecurrentRows"):
        super().extend(other)
        self.rows += other.rows

    def checkpoint(self):
        self.saved = list(self.cache)  # references: the layers assign new arrays, never write into these

    def restore(self, rows: Sequence[int]):
        """Put ``rows`` back to their states at the last ``checkpoint``."""
        index = mx.array(list(rows))
        for state, saved in zip(self.cache, self.saved):
            if state is not None:  # a state first made in the pass started from zeros
                state[index] = 0 if saved is None else saved[index]


def _batched(layer, rows: int, mask_dims: int):
    """The batched form of one layer's cache (``make_prompt_cache``'s kinds, by class: a renaming table)."""
    if isinstance(layer, CacheList):
        return CacheList(*(_batched(child, rows, mask_dims) for child in layer.caches))
    if isinstance(layer, RotatingKVCache) and not layer.keep:
        return RaggedKVCache([0] * rows, window=layer.max_size, mask_dims=mask_dims)
    if type(layer) is KVCache:
        return RaggedKVCache([0] * rows, mask_dims=mask_dims)
    if type(layer) is ArraysCache:
        return RecurrentRows(len(layer.cache), rows)
    raise CacheKindError(f"its {type(layer).__name__} layers cannot be batched")


class BatchCache:
    """A batch's cache: per model layer, the batched form of its kind (``layers``, what the model is
    called with), and the operations on rows that the generator applies to all of them at once."""

    def __init__(self, model, rows: int, mask_dims: int = 4):
        try:
            self.layers = [_batched(layer, rows, mask_dims) for layer in make_prompt_cache(model)]
        except CacheKindError as error:
            raise CacheKindError(f"{architecture(model)}: {error}") from None
        leaves = layers_of(self.layers)
        self.attention = [layer for layer in leaves if isinstance(layer, RaggedKVCache)]
        self.recurrent = [layer for layer in leaves if isinstance(layer, RecurrentRows)]
        self.rows = rows

    @property
    def ends(self) -> list:
        """Each row's end slot (all 0 for a model without attention layers: nothing drifts)."""
        return list(self.attention[0].ends) if self.attention else [0] * self.rows

    def arrays(self) -> list:
        """Every array the cache holds (to evaluate)."""
        states = [state for layer in self.recurrent for state in layer.cache if state is not None]
        return [layer.state for layer in self.attention] + states

    def trim_rows(self, counts: Sequence[int]):
        """Drop the last ``counts[b]`` tokens of row b in every attention layer."""
        if any(counts):
            device_counts = mx.array(counts)
            for layer in self.attention:
                layer.trim_rows(counts, device_counts)

    def prepare(self, lengths: Sequence[int], width: int):
        """Before a ``width``-wide pass in which row b feeds ``lengths[b]`` real tokens."""
        if self.recurrent and min(lengths) < width:
            for layer in self.recurrent:
                layer.prepare(lengths=list(lengths))

    def finalize(self):
        for layer in self.recurrent:
            layer.finalize()

    def checkpoint(self):
        for layer in self.recurrent:
            layer.checkpoint()

    def restore(self, rows: Sequence[int]):
        for layer in self.recurrent:
            layer.restore(rows)

    def filter(self, keep: Sequence[int]):
        for layer in self.layers:
            layer.filter(list(keep))
        self.rows = len(keep)

    def extend(self, other: "BatchCache"):
        for layer, new_layer in zip(self.layers, other.layers):
            layer.extend(new_layer)
        self.rows += other.rows

    def realign(self):
        for layer in self.attention:
            layer.realign()

    def row_entries(self, row: int, length: int) -> CachedPrefix:
        """Row ``row``'s cache, which holds the first ``length`` tokens of its text (a copy)."""
        states = [[mx.contiguous(state[row : row + 1]) for state in layer.cache if state is not None]
                  for layer in self.recurrent]
        return CachedPrefix(length, [layer.row_entries(row) for layer in self.attention], states)


class Prefill:
    """Prompts being run into a new ``BatchCache`` one chunk at a time (``step``), so that a caller can
    interleave decoding steps with a long prompt's prefill.

    Args:
        cached: per prompt, None or a ``CachedPrefix`` of its first tokens; only the rest is run.

    Each row writes its chunk at its own end, right-padded to the longest, and drops its padding;
    once all are in, the rows are aligned (``realign``) so that decoding starts on the slice path.
    """

    def __init__(self, model, prompts: Sequence[Sequence[int]], step_size: int = 512, cached=None,
                 mask_dims: int = 4):
        cached = [None] * len(prompts) if cached is None else list(cached)
        self.model, self.step_size = model, step_size
        self.cache = BatchCache(model, len(prompts), mask_dims)
        lengths = [0 if c is None else c.length for c in cached]
        self.pending = [list(prompt[length:]) for prompt, length in zip(prompts, lengths)]
        if any(lengths):
            self._fill([c for c in cached], lengths, max(len(p) for p in prompts))

    def _fill(self, cached: list, lengths: list, longest: int):
        """Write the cached prefixes into the new cache, every other row's part empty (zero states)."""
        rows, filled = len(cached), next(c for c in cached if c is not None)
        size = (longest + RaggedKVCache.step - 1) // RaggedKVCache.step * RaggedKVCache.step
        for index, (layer, (layer_keys, layer_values)) in enumerate(zip(self.cache.attention, filled.attention)):
            _, heads, _, key_dim = layer_keys.shape
            layer.keys = mx.zeros((rows, heads, size, key_dim), layer_keys.dtype)
            layer.values = mx.zeros((rows, heads, size, layer_values.shape[3]), layer_values.dtype)
            layer._set([0] * rows, lengths)
            for row, prefix in enumerate(cached):
                if prefix is not None:
                    layer.keys[row : row + 1, :, : lengths[row]] = prefix.attention[index][0]
                    layer.values[row : row + 1, :, : lengths[row]] = prefix.attention[index][1]
        for index, (layer, states) in enumerate(zip(self.cache.recurrent, filled.states)):
            layer.cache = [mx.zeros((rows, *state.shape[1:]), state.dtype) for state in states]
            for row, prefix in enumerate(cached):
                for state, row_state in zip(layer.cache, prefix.states[index] if prefix is not None else []):
                    state[row : row + 1] = row_state

    def step(self) -> bool:
        """Run the next chunk; True once every prompt is in the cache."""
        chunks = [tokens[: self.step_size] for tokens in self.pending]
        width = max(len(chunk) for chunk in chunks)
        if width:
            self.cache.prepare([len(chunk) for chunk in chunks], width)
            self.model(mx.array([chunk + [0] * (width - len(chunk)) for chunk in chunks]), cache=self.cache.layers)
            self.cache.finalize()
            self.cache.trim_rows([width - len(chunk) for chunk in chunks])
        self.pending = [tokens[self.step_size :] for tokens in self.pending]
        done = not any(self.pending)
        if done:
            self.cache.realign()
        mx.eval(self.cache.arrays())
        return done


def probe(model) -> tuple:
    """What a batch needs to know of ``model``, asked once with two rows of different lengths on a
    scratch cache: ``(mask_dims, masks_padding)``. ``mask_dims`` is 4, or 5 where attention keeps the
    query heads of a key head in a dimension of their own (gemma2's grouped scores); ``masks_padding``
    whether its recurrent layers keep a row's padded positions out of its state (mlx-lm's ``lengths``;
    some recurrent layers ignore it, and a batch then runs one row at a time)."""
    for mask_dims in (4, 5):
        try:
            # Two and three rows: a 4-d mask broadcasts (wrongly) where the rows number the key heads.
            for prompts in ([[1, 2, 3], [1]], [[1, 2, 3], [1], [1, 2]]):
                batch = _scratch(model, prompts, mask_dims)
                model(mx.array([[1]] * len(prompts)), cache=batch.layers)  # rows apart: an array mask
                mx.eval(batch.arrays())
            break
        except CacheKindError:
            raise
        except ValueError:  # the mask does not broadcast against the scores: try the other shape
            if mask_dims == 5:
                raise
    if not batch.recurrent:
        return mask_dims, True
    batch, alone = _scratch(model, [[1, 2, 3], [1]], mask_dims), _scratch(model, [[1]], mask_dims)
    same = all(mx.allclose(mine[1], its[0], atol=1e-3).item()
               for layer, other in zip(batch.recurrent, alone.recurrent)
               for mine, its in zip(layer.cache, other.cache) if mine is not None)
    return mask_dims, same


def _scratch(model, prompts: list, mask_dims: int) -> BatchCache:
    """``prefill_rows`` on caches that grow a few slots at a time: a page of ``RaggedKVCache.step``
    slots per row would make the probe, not the rows, a one-row batch's peak memory."""
    prefill = Prefill(model, prompts, mask_dims=mask_dims)
    for layer in prefill.cache.attention:
        layer.step = 8
    while not prefill.step():
        pass
    return prefill.cache


def prefill_rows(model, prompts: Sequence[Sequence[int]], step_size: int = 512, mask_dims: int = 4) -> BatchCache:
    """A new cache holding ``prompts`` (token id lists, any lengths), run through ``model`` in chunks."""
    prefill = Prefill(model, prompts, step_size, mask_dims=mask_dims)
    while not prefill.step():
        pass
    return prefill.cache
