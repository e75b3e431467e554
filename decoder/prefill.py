"""Prompts into a cache of one row each, a chunk at a time, so that a caller can interleave decoding
with a long prefill. Right-padded, never left-padded: a position below 0 can make a NaN that spreads
to every row (docs/decoder.md)."""

from typing import Optional, Sequence

import mlx.core as mx

from .cache import Cache, make_cache


class Prefill:
    """Prompts being run into a ``Cache`` one chunk at a time (``step``).

    Args:
        cached: per prompt, None or a ``CachedPrefix`` of its first tokens; only the rest is run.
        mask_dims, max_rollback: the new cache's (``make_cache``).
        cache: the cache to run them into, its rows holding what comes before (default: a new one).
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
    ):
        cached = [None] * len(prompts) if cached is None else list(cached)
        self.model, self.step_size = model, step_size
        self.cache = (
            make_cache(model, len(prompts), max_rollback, mask_dims) if cache is None else cache
        )
        self.pending = [
            list(prompt[0 if c is None else c.length :]) for prompt, c in zip(prompts, cached)
        ]
        self.cache.fill(cached)

    def step(self) -> bool:
        """Run the next chunk; True once every prompt is in the cache."""
        chunks = [tokens[: self.step_size] for tokens in self.pending]
        width = max(len(chunk) for chunk in chunks)
        if width:
            self.cache.prepare([len(chunk) for chunk in chunks], width)
            self.model(
                mx.array([chunk + [0] * (width - len(chunk)) for chunk in chunks], mx.int32),
                cache=self.cache.layers,
            )
            self.cache.finalize()
            self.cache.rewind([width - len(chunk) for chunk in chunks])
        self.pending = [tokens[self.step_size :] for tokens in self.pending]
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
