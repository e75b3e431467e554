"""One KV cache for a batch whose rows each keep their own length, so each row rolls back alone.

A verification pass writes ``[B, W]`` tokens, and row ``b`` keeps only ``1 + accepted_b`` of
them. mlx-lm's ``BatchKVCache`` keeps one write index for all rows, so a row that keeps fewer
tokens than another must be rolled (``prepare(right_padding=...)`` / ``finalize()``): a copy of
the whole cache per step. Here every row has its own end instead (vLLM's rule: rejected slots are
simply written over by the next step):

    row b holds its tokens in slots [start_b, end_b); its RoPE position is end_b - start_b
    a pass of N tokens writes row b's at [end_b, end_b + N)   (one scatter, or a slice when aligned)
    trim_rows(cache, counts) moves each end back by its own count

Slots outside a row's ``[start, end)`` (left padding, rejected tails) are masked, never zeroed:
a zero key still adds e^0 to a softmax. Measured (``python -m benchmarks.batch_cache``, 8 rows, a
5-wide pass, SmolLM2-135M on a 2-core CPU; benchmarks/results/batch.md): a step with per-row
rollback here costs within 4% of one whose rows all keep the same count (no rollback at all), at
1k and 4k tokens of context; rolling rows instead adds 38% at 1k and 92% at 4k. A per-row mask of
dead slots, compacted lazily, would make the cache grow by W slots a step instead of by the
tokens kept, and compacting is the same copy as a roll, so it was not kept either.

Rows drift apart as they accept different numbers of tokens, so every row attends over the
longest one's slots; ``realign`` (a roll, run rarely) packs them right again.
"""

from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, dynamic_roll


class RaggedKVCache(_BaseCache):
    """A per-layer cache of ``B`` rows, each with its own start and end slot (host ints).

    Args:
        starts: the first slot of each row's tokens (its left padding).
        ends: one past each row's last written slot; defaults to 0, for a left-padded batch whose
            padding is written with its prompts (a row's length, ``end - start``, starts negative).
    """

    step = 256

    def __init__(self, starts: Sequence[int], ends: Optional[Sequence[int]] = None):
        self.keys = self.values = None
        self._set(list(starts), [0] * len(starts) if ends is None else list(ends))

    def _set(self, starts: List[int], ends: List[int]):
        # Host copies decide shapes and fast paths; device copies feed RoPE, the scatter and the mask.
        self.starts, self.ends = starts, ends
        self.offset = mx.array([end - start for start, end in zip(starts, ends)])
        self._starts, self._ends = mx.array(starts), mx.array(ends)

    def aligned(self) -> bool:
        return len(set(self.ends)) <= 1

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        batch, heads, num_new, _ = keys.shape
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
        """(B, 1, N, max end + N): query q of row b sees slots [start_b, end_b + q] (and its own)."""
        if window_size is not None:
            raise ValueError("RaggedKVCache does not support sliding-window attention")
        if self.aligned() and not any(self.starts) and not return_array:  # plain causal attention
            return None if N == 1 else "causal"
        return self._mask(N)

    def _mask(self, N: int) -> mx.array:
        slots = mx.arange(max(self.ends) + N)
        own = self._ends[:, None, None] + mx.arange(N)[None, :, None]  # each query's own slot
        # A padding query sees only itself: a query that sees nothing would turn into NaN, and the
        # next layer's keys and values with it (0 * NaN is NaN even where the mask hides them).
        return (((slots >= self._starts[:, None, None]) & (slots <= own)) | (slots == own))[:, None]

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

    def waste(self) -> float:
        """The share of attended slots that belong to no row (padding and ragged ends)."""
        top = max(self.ends, default=0)
        used = sum(end - start for start, end in zip(self.starts, self.ends))
        return 1 - used / max(top * len(self.ends), 1)

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


def make_ragged_cache(model, starts: Sequence[int]) -> list:
    """One ``RaggedKVCache`` per layer of ``model``, rows starting at ``starts`` (left padding)."""
    return [RaggedKVCache(starts) for _ in range(len(model.layers))]


def trim_rows(cache: list, counts: Sequence[int]):
    """Drop the last ``counts[b]`` tokens of row b in every layer."""
    if any(counts):
        device_counts = mx.array(counts)
        for layer in cache:
            layer.trim_rows(counts, device_counts)


def prefill_rows(model, prompts: Sequence[Sequence[int]], step_size: int = 512) -> list:
    """A new cache holding ``prompts`` (token id lists, any lengths), left-padded into one batch and
    run through ``model`` in chunks of ``step_size`` (bounded attention memory)."""
    prefill = Prefill(model, prompts, step_size)
    while not prefill.step():
        pass
    return prefill.cache


class Prefill:
    """Prompts being run into a new cache one chunk at a time (``step``), so that a caller can
    interleave decoding steps with a long prompt's prefill.

    Args:
        cached: per prompt, None or the KV entries of its first L tokens (per layer a
            ``(keys, values)`` pair of shape ``[1, heads, L, dim]``); only the rest is run.

    Without cached prefixes the prompts are left-padded and written aligned (the padding is run
    with them). A row with a cached prefix keeps it right before its own remaining tokens; rows
    then feed different counts per chunk, right-padded to the longest, and each drops its padding.
    """

    def __init__(self, model, prompts: Sequence[Sequence[int]], step_size: int = 512, cached=None):
        cached = [None] * len(prompts) if cached is None else list(cached)
        lengths = [0 if c is None else c[0][0].shape[2] for c in cached]
        longest = max(len(prompt) for prompt in prompts)
        starts = [longest - len(prompt) for prompt in prompts]
        self.model, self.step_size = model, step_size
        if not any(lengths):
            self.cache = make_ragged_cache(model, starts)
            self.pending = [[0] * start + list(prompt) for start, prompt in zip(starts, prompts)]
            return
        ends = [start + length for start, length in zip(starts, lengths)]
        self.pending = [list(prompt[length:]) for prompt, length in zip(prompts, lengths)]
        self.cache = [RaggedKVCache(starts, ends) for _ in range(len(model.layers))]
        filled = next(c for c in cached if c is not None)
        for layer, (layer_keys, layer_values) in zip(self.cache, filled):
            size = (longest + RaggedKVCache.step - 1) // RaggedKVCache.step * RaggedKVCache.step
            _, heads, _, key_dim = layer_keys.shape
            layer.keys = mx.zeros((len(prompts), heads, size, key_dim), layer_keys.dtype)
            layer.values = mx.zeros((len(prompts), heads, size, layer_values.shape[3]), layer_values.dtype)
        for row, entries in enumerate(cached):
            if entries is None:
                continue
            for layer, (keys, values) in zip(self.cache, entries):
                layer.keys[row : row + 1, :, starts[row] : ends[row]] = keys
                layer.values[row : row + 1, :, starts[row] : ends[row]] = values

    def step(self) -> bool:
        """Run the next chunk; True once every prompt is in the cache."""
        chunks = [tokens[: self.step_size] for tokens in self.pending]
        width = max(len(chunk) for chunk in chunks)
        if width:
            self.model(mx.array([chunk + [0] * (width - len(chunk)) for chunk in chunks]), cache=self.cache)
            trim_rows(self.cache, [width - len(chunk) for chunk in chunks])
            mx.eval([layer.state for layer in self.cache])
        self.pending = [tokens[self.step_size :] for tokens in self.pending]
        return not any(self.pending)
