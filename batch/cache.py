"""Prompts into a batch's cache (``cache.Cache`` at B rows), and what a batch must know of a model.

Prompts are right-padded, never left-padded: every written token then has a position >= 0 (a model
may scale by its position: ministral3's log(1 + floor(pos / n)) is -inf below 0, and the NaN it makes
in a padded slot's values spreads to every row through 0 * NaN). Each row writes its chunk at its own
end and drops its padding (``Cache.rewind``); rows then drift apart as they accept different numbers
of tokens, so every row attends over the longest one's slots, and ``realign`` (a roll, run rarely)
packs them right again.
"""

from typing import Sequence

import mlx.core as mx

from cache import Cache, CacheKindError, KVRows, make_cache


class Prefill:
    """Prompts being run into a new ``cache.Cache`` one chunk at a time (``step``), so that a caller can
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
        self.cache = make_cache(model, len(prompts), mask_dims=mask_dims)
        self.pending = [list(prompt[0 if c is None else c.length :]) for prompt, c in zip(prompts, cached)]
        self.cache.fill(cached)

    def step(self) -> bool:
        """Run the next chunk; True once every prompt is in the cache."""
        chunks = [tokens[: self.step_size] for tokens in self.pending]
        width = max(len(chunk) for chunk in chunks)
        if width:
            self.cache.prepare([len(chunk) for chunk in chunks], width)
            self.model(mx.array([chunk + [0] * (width - len(chunk)) for chunk in chunks]), cache=self.cache.layers)
            self.cache.finalize()
            self.cache.rewind([width - len(chunk) for chunk in chunks])
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


def _scratch(model, prompts: list, mask_dims: int) -> Cache:
    """``prefill_rows`` on caches that grow a few slots at a time: a page of ``KVRows.step``
    slots per row would make the probe, not the rows, a one-row batch's peak memory."""
    prefill = Prefill(model, prompts, mask_dims=mask_dims)
    for layer in prefill.cache.attention:
        layer.step = 8
    while not prefill.step():
        pass
    return prefill.cache


def prefill_rows(model, prompts: Sequence[Sequence[int]], step_size: int = 512, mask_dims: int = 4) -> Cache:
    """A new cache holding ``prompts`` (token id lists, any lengths), run through ``model`` in chunks."""
    prefill = Prefill(model, prompts, step_size, mask_dims=mask_dims)
    while not prefill.step():
        pass
    return prefill.cache
