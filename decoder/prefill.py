"""Prompts into a cache of one row each, a chunk at a time, so that a caller can interleave decoding
with a long prefill. Right-padded, never left-padded: a position below 0 can make a NaN that spreads
to every row (docs/decoder.md)."""

from typing import Optional, Sequence

import mlx.core as mx

from .cache import Cache, CachedPrefix, make_cache


class PrefixStore:
    """Prompts' caches in blocks of ``block_tokens`` (``prompt_store.PromptStore``); a prefill's
    chunks end on block boundaries (each one where ``each_block``) for ``capture`` to store what
    the cache holds there."""

    block_tokens: int
    each_block: bool  # what a boundary keeps exists only there: windows, recurrent states

    def lookup(self, prompt: Sequence[int], held: int = 0) -> Optional[CachedPrefix]:
        raise NotImplementedError  # the longest stored prefix of prompt[:-1], if over ``held``

    def capture(self, tokens: Sequence[int], cache: Cache, row: int):
        raise NotImplementedError


class Prefill:
    """Prompts being run into a ``Cache`` one chunk at a time (``step``).

    Args:
        cached: per prompt, None or a ``CachedPrefix`` of its first tokens; only the rest is run.
        mask_dims, max_rollback: the new cache's (``make_cache``).
        cache: the cache to run them into, its rows holding their first tokens (default: a new
            one).
        store: a ``PrefixStore`` that captures each block boundary the prompts cross.
        kv_bits, kv_group_size: the new cache's quantization (``make_cache``).
    """

    def __init__(
        self,
        model,
        prompts: Sequence[Sequence[int]],
        step_size: int = 512,
        cached=None,
        mask_dims: int = 4,
        max_rollback: Optional[int] = None,
        cache: Optional[Cache] = None,
        store: Optional[PrefixStore] = None,
        kv_bits: Optional[int] = None,
        kv_group_size: int = 64,
    ):
        cached = [None] * len(prompts) if cached is None else list(cached)
        if store is not None and store.each_block:
            step_size = min(step_size, store.block_tokens)
        self.model, self.store, self.step_size = model, store, step_size
        if cache is None:
            cache = make_cache(model, len(prompts), max_rollback, mask_dims, kv_bits, kv_group_size)
        self.cache = cache
        self.prompts = [list(prompt) for prompt in prompts]
        self.cache.fill(cached)
        self.held = [
            (self.cache.held(row) or 0) if c is None else c.length for row, c in enumerate(cached)
        ]

    @property
    def pending(self) -> list:
        return [prompt[held:] for prompt, held in zip(self.prompts, self.held)]

    def _chunk_end(self, held: int, length: int) -> int:
        room = self.cache.until_quantized()
        end = min(held + self.step_size, length, held + (room or length))
        if self.store is not None:  # end on the last block boundary it crosses, to capture it
            boundary = end - end % self.store.block_tokens
            end = boundary if boundary > held else end
        return end

    def step(self) -> bool:
        """Run the next chunk; True once every prompt is in the cache."""
        ends = [self._chunk_end(h, len(p)) for h, p in zip(self.held, self.prompts)]
        chunks = [p[h:end] for p, h, end in zip(self.prompts, self.held, ends)]
        width = max(len(chunk) for chunk in chunks)
        if width:
            self.cache.prepare([len(chunk) for chunk in chunks], width)
            self.model(
                mx.array([chunk + [0] * (width - len(chunk)) for chunk in chunks], mx.int32),
                cache=self.cache.layers,
            )
            self.cache.finalize()
            self.cache.rewind([width - len(chunk) for chunk in chunks])
        if self.store is not None:
            for row, (held, end) in enumerate(zip(self.held, ends)):
                if end > held and end // self.store.block_tokens > held // self.store.block_tokens:
                    self.store.capture(self.prompts[row][:end], self.cache, row)
        self.held = ends
        done = not any(self.pending)
        if done and self.cache.rows > 1:
            self.cache.realign()
        mx.eval(self.cache.arrays())
        return done

    def run(self) -> Cache:
        """Every chunk to the end; returns the cache."""
        while not self.step():
            pass
        return self.cache


def prefill_rows(
    model,
    prompts: Sequence[Sequence[int]],
    step_size: int = 512,
    mask_dims: int = 4,
    max_rollback: Optional[int] = None,
) -> Cache:
    """A new cache holding ``prompts`` (token id lists, any lengths)."""
    return Prefill(model, prompts, step_size, mask_dims=mask_dims, max_rollback=max_rollback).run()
