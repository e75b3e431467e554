"""What a batch must know of a model (``probe``), asked once with scratch rows.

Prompts go into a batch's cache through ``decoder.prefill.Prefill``; rows then drift apart as they
accept different numbers of tokens, so every row attends over the longest one's slots, and
``realign`` (a roll, run rarely) packs them right again.
"""

import mlx.core as mx

from decoder.cache import Cache, CacheKindError
from decoder.prefill import Prefill


def probe(model) -> tuple:
    """What a batch needs to know of ``model``, asked once with two rows of different lengths on a
    scratch cache: ``(mask_dims, masks_padding)``. ``mask_dims`` is 4, or 5 where attention keeps
    the query heads of a key head in a dimension of their own (gemma2's grouped scores);
    ``masks_padding`` whether its recurrent layers keep a row's padded positions out of its state
    (mlx-lm's ``lengths``; some recurrent layers ignore it, and a batch then runs one row at a
    time)."""
    for mask_dims in (4, 5):
        try:
            # Two and three rows: a 4-d mask broadcasts (wrongly) where the rows number the key
            # heads.
            for prompts in ([[1, 2, 3], [1]], [[1, 2, 3], [1], [1, 2]]):
                batch = _scratch(model, prompts, mask_dims)
                # rows apart: an array mask
                model(mx.array([[1]] * len(prompts), mx.int32), cache=batch.layers)
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
    same = all(
        mx.allclose(mine[1], its[0], atol=1e-3).item()
        for layer, other in zip(batch.recurrent, alone.recurrent)
        for mine, its in zip(layer.cache, other.cache)
        if mine is not None
    )
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
