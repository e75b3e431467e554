"""The kinds of layer cache, one class each, for 1 to B rows (how they fit together: cache.py)."""

from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, _BaseCache, dynamic_roll


def parts_of(stored) -> tuple:
    """Keys or values as arrays: one, or a quantized layer's (weights, scales, biases)."""
    return stored if isinstance(stored, tuple) else (stored,)


def _like(parts: list, stored):
    """``parts`` in the form of ``stored``: a tuple where it is one, else the one array."""
    return tuple(parts) if isinstance(stored, tuple) else parts[0]


def each_part(function, stored):
    """``function`` over each part of ``stored`` (``parts_of``), in its form."""
    return _like([function(part) for part in parts_of(stored)], stored)


class KVRows(_BaseCache):
    """Keys and values of one attention layer for ``B`` rows, each with its own length.

    Per row (host ints): ``starts``/``ends``, the slots it holds, and ``origins``, the slot its
    position 0 would have, so a row's RoPE position is ``end - origin`` and ``start - origin``
    positions were dropped.

    Args:
        rows: how many rows (empty).
        window: a sliding-window layer's window; None for full attention.
        max_rollback: how far back a sliding row can go across calls (a pass is undone whole).
        mask_dims: 4 for ``(B, 1, N, S)`` masks; 5 for ``(B, 1, 1, N, S)`` (gemma2's).
    """

    step = 256  # slots a full-attention layer grows by
    tree = None  # during a tree pass: ``(depth, visible)`` of its slots (``begin_tree``)
    window_step = 64  # slots a sliding layer grows and drops by (beyond window + max_rollback)
    max_rollback = 32  # the default: more than a draft's one-token calls span

    def __init__(
        self,
        rows: int,
        window: Optional[int] = None,
        max_rollback: Optional[int] = None,
        mask_dims: int = 4,
    ):
        self.keys = self.values = None
        self.window, self.mask_dims = window, mask_dims
        if max_rollback is not None:
            self.max_rollback = max_rollback
        self._set([0] * rows, [0] * rows, [0] * rows)

    def _set(self, starts: List[int], ends: List[int], origins: List[int]):
        self.starts, self.ends, self.origins = starts, ends, origins
        # RoPE reads the offset: an int for one row (as mlx-lm's KVCache), else one per row.
        positions = [end - origin for end, origin in zip(ends, origins)]
        self.offset = positions[0] if len(ends) == 1 else mx.array(positions, mx.int32)

    @property
    def rows(self) -> int:
        return len(self.ends)

    def _first_seen(self) -> int:
        """The first slot a query of the next call can see (before that call drops anything)."""
        if self.window is None:
            return min(self.starts)
        return min(max(start, end - self.window + 1) for start, end in zip(self.starts, self.ends))

    def _make_room(self, num_new: int, keys: mx.array, values: mx.array):
        """A new buffer with room for ``num_new`` more slots, without the slots no row needs any
        more."""
        top = max(self.ends)
        drop = min(self.starts)
        if self.window is not None:  # a sliding row needs its window and the rollback slack
            reach = self.window + self.max_rollback - 1
            drop = min(max(start, end - reach) for start, end in zip(self.starts, self.ends))
        step = self.step if self.window is None else self.window_step
        size = (top - drop + num_new + step - 1) // step * step
        for name, like in (("keys", keys), ("values", values)):
            new = each_part(
                lambda p: mx.zeros((self.rows, p.shape[1], size, p.shape[3]), p.dtype), like
            )
            if getattr(self, name) is not None and top > drop:
                for part, old in zip(parts_of(new), parts_of(getattr(self, name))):
                    part[..., : top - drop, :] = old[..., drop:top, :]
            setattr(self, name, new)
        self._set(
            [max(s - drop, 0) for s in self.starts],
            [e - drop for e in self.ends],
            [o - drop for o in self.origins],
        )
        return drop

    def _stored(self, array: mx.array):
        """New keys or values as the layer keeps them (``QuantizedKVRows``: quantized)."""
        return array

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        keys, values = self._stored(keys), self._stored(values)
        first, num_new = self._first_seen(), parts_of(keys)[0].shape[2]
        if self.keys is None or max(self.ends) + num_new > parts_of(self.keys)[0].shape[2]:
            first -= self._make_room(num_new, keys, values)
        same = len(set(self.ends)) == 1  # every row writes the same slots: a slice update
        if not same:
            slots = (mx.array(self.ends, mx.int32)[:, None] + mx.arange(num_new))[:, None, :, None]
        for name, new in (("keys", keys), ("values", values)):
            parts = list(parts_of(getattr(self, name)))
            for index, (part, written) in enumerate(zip(parts, parts_of(new))):
                if same:
                    part[..., self.ends[0] : self.ends[0] + num_new, :] = written
                else:
                    shape = mx.broadcast_to(slots, written.shape)
                    parts[index] = mx.put_along_axis(part, shape, written, axis=2)
            setattr(self, name, _like(parts, new))
        self._set(self.starts, [end + num_new for end in self.ends], self.origins)
        top = max(self.ends)
        return (
            each_part(lambda p: p[..., first:top, :], self.keys),
            each_part(lambda p: p[..., first:top, :], self.values),
        )

    def make_mask(
        self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kwargs
    ):
        """Query q of row b sees its slots up to its own, within its window; keys start at
        ``_first_seen``."""
        # A query never sees more than the cache's window, however wide a window the model asks for
        # (plamo3 asks for one more): a verify pass must see what one-token steps see.
        window = min(window_size or self.window, self.window) if self.window else window_size
        first = self._first_seen()
        if self.tree is not None:
            return self._tree_mask(N, first, window)
        same = len(set(self.ends)) == 1 and len(set(self.starts)) == 1
        if same and not return_array and (window is None or N == 1 and window == self.window):
            if window is None and self.starts[0] == first:
                return None if N == 1 else "causal"
            if N == 1 and self.ends[0] - first <= window:
                return None  # one query sees every key it is given
        slots = mx.arange(first, max(self.ends) + N)
        # each query's own slot
        own = mx.array(self.ends, mx.int32)[:, None, None] + mx.arange(N)[None, :, None]
        seen = (slots >= mx.array(self.starts, mx.int32)[:, None, None]) & (slots <= own)
        if window is not None:  # a row's slots are contiguous: slot distance is position distance
            seen = seen & (slots > own - window)
        # A padding query sees only itself: a query that sees nothing would turn into NaN, and the
        # next layer's keys and values with it (0 * NaN is NaN even where the mask hides them).
        mask = (seen | (slots == own))[:, None]
        return mask[:, None] if self.mask_dims == 5 else mask

    def begin_tree(self, depth: mx.array, visible: mx.array):
        """Before a pass whose ``(B, N)`` tokens sit at ``depth`` past each row's end and see the
        pass's slots ``visible`` ``(B, N, N)`` (``decoder.tree.layout``): the rope modules read
        one position per token from ``offset``."""
        self.tree = (depth, visible)
        positions = mx.array(
            [end - origin for end, origin in zip(self.ends, self.origins)], mx.int32
        )
        self.offset = positions[:, None] + depth

    def end_tree(self):
        self.tree = None
        self._set(self.starts, self.ends, self.origins)

    def _tree_mask(self, N: int, first: int, window: Optional[int]) -> mx.array:
        """``make_mask`` in a tree pass: a query sees its row's past, within its window by
        position, and the pass slots ``visible`` says."""
        depth, visible = self.tree
        slots = mx.arange(first, max(self.ends) + N)
        ends = mx.array(self.ends, mx.int32)[:, None, None]
        past = (slots >= mx.array(self.starts, mx.int32)[:, None, None]) & (slots < ends)
        index = slots - ends  # (B, 1, S): the slot's place in the pass
        in_pass = (index >= 0) & (index < N)
        index = mx.broadcast_to(mx.clip(index, 0, N - 1), (depth.shape[0], N, slots.shape[0]))
        seen = in_pass & mx.take_along_axis(visible, index, axis=2)
        if window is not None:
            query = depth[:, :, None]  # positions past the row's end
            key = mx.where(in_pass, mx.take_along_axis(depth[:, None, :], index, axis=2), index)
            past = past & (slots > ends + query - window)
            seen = seen & (key > query - window)
        mask = (past | seen)[:, None]
        return mask[:, None] if self.mask_dims == 5 else mask

    def compact(self, width: int, kept: Sequence[Optional[Sequence[int]]]):
        """After a tree pass ``width`` slots wide: row b's slots ``kept[b]`` (offsets into the
        pass, in order) move to the pass's first slots; None keeps the row as it is. The caller
        then trims what follows them."""
        for row, slots in enumerate(kept):
            if slots is None or list(slots) == list(range(len(slots))):
                continue
            begin = self.ends[row] - width
            taken = mx.array([begin + slot for slot in slots], mx.int32)
            for name in ("keys", "values"):
                for array in parts_of(getattr(self, name)):
                    array[row : row + 1, :, begin : begin + len(slots)] = mx.take(
                        array[row : row + 1], taken, axis=2
                    )

    def can_trim(self, row: int) -> int:
        """How many of row ``row``'s last tokens it can drop and still hold every key its next query
        sees."""
        held = self.ends[row] - self.starts[row]
        if self.window is None or self.starts[row] == self.origins[row]:  # nothing dropped yet
            return held
        return max(held - self.window + 1, 0)

    def trim_rows(self, counts: Sequence[int]):
        """Drop the last ``counts[b]`` tokens of each row b; raises if a row cannot drop that
        many."""
        for row, count in enumerate(counts):
            if count > self.can_trim(row):  # a count that says less was done is never ignored
                raise RuntimeError(
                    f"row {row} of a {self.window or 'full'}-window attention layer cannot drop "
                    f"its last {count} tokens (it holds {self.ends[row] - self.starts[row]})"
                )
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
        starts, ends, origins = (
            [values[i] for i in keep] for values in (self.starts, self.ends, self.origins)
        )
        shift = min(starts, default=0)
        if self.keys is not None:
            rows = mx.array(list(keep), mx.int32)
            self.keys = each_part(lambda p: p[rows, :, shift:], self.keys)
            self.values = each_part(lambda p: p[rows, :, shift:], self.values)
        self._set(
            [s - shift for s in starts], [e - shift for e in ends], [o - shift for o in origins]
        )

    def extend(self, other: "KVRows"):
        """Append ``other``'s rows, right-aligned with these so no row attends over the other's
        past."""
        top = max(self.ends + other.ends, default=0)
        shifts = [top - max(cache.ends, default=0) for cache in (self, other)]
        moved = [
            [[v + shift for v in values] for values in (cache.starts, cache.ends, cache.origins)]
            for cache, shift in zip((self, other), shifts)
        ]
        filled = [cache for cache in (self, other) if cache.keys is not None]
        if filled:
            size = max(
                parts_of(c.keys)[0].shape[2] + shift
                for c, shift in zip((self, other), shifts)
                if c.keys is not None
            )
            empty = [cache.keys is None for cache in (self, other)]  # rows with nothing cached
            for name in ("keys", "values"):
                like = getattr(filled[0], name)
                joined = []
                for index, part in enumerate(parts_of(like)):
                    pieces = []
                    for cache, shift, nothing in zip((self, other), shifts, empty):
                        if nothing:
                            shape = (cache.rows, part.shape[1], size, part.shape[3])
                            pieces.append(mx.zeros(shape, part.dtype))
                        else:
                            mine = parts_of(getattr(cache, name))[index]
                            pad = [(0, 0), (0, 0), (shift, size - shift - mine.shape[2]), (0, 0)]
                            pieces.append(mx.pad(mine, pad))
                    joined.append(mx.concatenate(pieces))
                setattr(self, name, _like(joined, like))
        self._set(*(mine + theirs for mine, theirs in zip(*moved)))

    def realign(self):
        """Roll each row right so that all rows end at the same slot (a copy of the cache)."""
        top = max(self.ends)
        shifts = [top - end for end in self.ends]
        if self.keys is not None and any(shifts):
            shift = mx.array(shifts, mx.int32)[:, None]
            self.keys = each_part(lambda p: dynamic_roll(p, shift, axis=2), self.keys)
            self.values = each_part(lambda p: dynamic_roll(p, shift, axis=2), self.values)
        self._set(
            *(
                [v + d for v, d in zip(values, shifts)]
                for values in (self.starts, self.ends, self.origins)
            )
        )

    def extract(self, row: int, since: int = 0) -> tuple:
        """Row ``row``'s ``(keys, values, first position held)`` from position ``since`` on,
        ``[1, heads, n, dim]`` each (a copy)."""
        start, end = max(self.starts[row], since + self.origins[row]), self.ends[row]
        return (
            each_part(lambda p: mx.contiguous(p[row : row + 1, :, start:end]), self.keys),
            each_part(lambda p: mx.contiguous(p[row : row + 1, :, start:end]), self.values),
            start - self.origins[row],
        )

    def fill(self, row: int, keys: mx.array, values: mx.array, first: int):
        """Row ``row`` of an empty cache holds ``keys``/``values`` of positions ``[first, first +
        n)``."""
        n = parts_of(keys)[0].shape[2]
        if self.keys is None or n > parts_of(self.keys)[0].shape[2]:
            self._make_room(n, keys, values)
        for mine, given in zip(
            parts_of(self.keys) + parts_of(self.values), parts_of(keys) + parts_of(values)
        ):
            mine[row : row + 1, :, :n] = given
        starts, ends, origins = list(self.starts), list(self.ends), list(self.origins)
        starts[row], ends[row], origins[row] = 0, n, -first
        self._set(starts, ends, origins)

    @property
    def state(self):
        """What mlx-lm's ``save_prompt_cache`` writes: the slots any row holds, each row's
        ``(start, end, origin)`` and the layer's settings; ``from_state`` builds it again."""
        keys, values = self.keys, self.values
        if keys is not None:  # the slots past every row's end hold nothing yet
            top = max(self.ends)
            keys, values = (each_part(lambda p: p[..., :top, :], kept) for kept in (keys, values))
        rows = mx.array([self.starts, self.ends, self.origins], mx.int32)
        return keys, values, rows, self.window, self.max_rollback, self.mask_dims

    @state.setter
    def state(self, state):
        self.keys, self.values, rows, self.window, self.max_rollback, self.mask_dims = state
        self._set(*(row.tolist() for row in rows))

    def size(self) -> int:
        return max(self.ends, default=0)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(part.nbytes for part in parts_of(self.keys) + parts_of(self.values))

    def quantized(self, bits: int, group_size: int) -> "QuantizedKVRows":
        """This layer with what it holds quantized: the arrays ``QuantizedKVRows`` would have
        written (``mx.quantize`` works per token, so quantizing later changes nothing)."""
        layer = QuantizedKVRows(
            self.rows,
            bits,
            group_size,
            window=self.window,
            max_rollback=self.max_rollback,
            mask_dims=self.mask_dims,
        )
        if self.keys is not None:
            layer.keys, layer.values = layer._stored(self.keys), layer._stored(self.values)
        layer._set(self.starts, self.ends, self.origins)
        return layer


class QuantizedKVRows(KVRows):
    """``KVRows`` keeping keys and values as ``mx.quantize`` gives them, each written once; mlx-lm's
    attention runs its quantized kernel on a cache with ``bits``."""

    def __init__(self, rows: int, bits: int, group_size: int = 64, **options):
        super().__init__(rows, **options)
        self.bits, self.group_size = bits, group_size

    def _stored(self, array: mx.array) -> tuple:
        return tuple(mx.quantize(array, group_size=self.group_size, bits=self.bits))

    def fill(self, row: int, keys, values, first: int):
        if not isinstance(keys, tuple):  # kept before the cache turned quantized
            keys, values = self._stored(keys), self._stored(values)
        super().fill(row, keys, values, first)


class StateRows(ArraysCache):
    """A recurrent layer's states for ``rows`` rows (mlx-lm's ``ArraysCache``: rows shorter than a
    pass are kept out of it through ``prepare(lengths=...)``), that can put rows back to a
    checkpoint."""

    def __init__(self, size: int, rows: int):
        super().__init__(size)
        self.rows, self.saved = rows, None

    @property
    def batch_size(self) -> int:  # known even before the first pass makes the states
        return self.rows

    @property
    def state(self):
        return self.cache, self.left_padding, self.lengths, self.rows

    @state.setter
    def state(self, state):  # mlx-lm's ``from_state`` sets it on an object it made without __init__
        self.cache, self.left_padding, self.lengths, self.rows = state
        self.saved = None

    def filter(self, keep: Sequence[int]):
        super().filter(mx.array(list(keep), mx.int32))
        self.rows = len(keep)

    def extend(self, other: "StateRows"):
        super().extend(other)
        self.rows += other.rows

    def checkpoint(self):
        # references: the layers assign new arrays, never write into these
        self.saved = list(self.cache)

    def restore(self, rows: Sequence[int]):
        """Put ``rows`` back to their states at the last ``checkpoint``."""
        if len(rows) == self.rows:  # every row: the saved arrays themselves
            self.cache = list(self.saved)
            return
        index = mx.array(list(rows), mx.int32)
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
    """mlx-lm's ``ChunkedKVCache`` for one row, with the checked rollback of ``KVRows``. One row
    only: llama4 builds its chunk mask from the first layer's scalar offset and
    ``start_position``."""

    rows = 1

    @property
    def ends(self) -> list:
        return [self.offset]

    def can_trim(self, row: int = 0) -> int:
        return self.offset - self.start_position

    def trim_rows(self, counts: Sequence[int]):
        if self.trim(counts[0]) != counts[0]:
            raise RuntimeError(f"a chunked attention layer cannot drop its last {counts[0]} tokens")
