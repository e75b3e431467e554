"""One pass verifying a draft tree on any attention model mlx-lm builds: a node sees its ancestors
through the cache layer's mask (``KVRows.make_mask``) at its depth's position through the model's
rope modules (``TreeRope``), which ``enable_trees`` wraps, once and explicitly. docs/draft_trees.md.
"""

import inspect
import logging
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from .cache import architecture, layers_of, make_cache
from .tree import layout


class TreeRope(nn.Module):
    """The model's own rope module; an ``offset`` of shape ``(B, T)`` rotates each token alone."""

    def __init__(self, rope):
        super().__init__()
        self.rope = rope

    def __call__(self, x: mx.array, offset=0):
        if not isinstance(offset, mx.array) or offset.ndim < 2:
            return self.rope(x, offset=offset)
        batch, length, dims = x.shape[0], x.shape[-2], x.shape[-1]
        # (B, ..., T, D) -> (B * T, M, 1, D): every token its own row, heads kept together
        heads = x.reshape(batch, -1, length, dims).swapaxes(1, 2)
        heads = heads.reshape(batch * length, -1, 1, dims)
        rotated = self.rope(heads, offset=offset.reshape(-1))
        rotated = rotated.reshape(batch, length, -1, dims).swapaxes(1, 2)
        return rotated.reshape(x.shape)


def _is_rope(module) -> bool:
    """mlx's ``nn.RoPE``, or a module with no submodules whose call takes an ``offset`` (mlx-lm's
    other rope classes, a model file's own); the probe checks the result."""
    if isinstance(module, nn.RoPE):
        return True
    return not module.children() and "offset" in inspect.signature(type(module).__call__).parameters


def _wrap_ropes(module, wrapped: dict):
    """Put a ``TreeRope`` around every rope module under ``module`` (a module shared by several
    layers gets one wrapper)."""
    for key, child in module.items():
        children = child if isinstance(child, (list, tuple)) else [child]
        for index, item in enumerate(children):
            if not isinstance(item, nn.Module) or isinstance(item, TreeRope):
                continue
            if _is_rope(item):
                wrapper = wrapped.setdefault(id(item), TreeRope(item))
                if isinstance(child, list):
                    child[index] = wrapper
                elif not isinstance(child, tuple):
                    setattr(module, key, wrapper)
            else:
                _wrap_ropes(item, wrapped)


def _probe(model) -> bool:
    """Whether a tree pass scores nodes as chain passes do: two copies of one node at one depth,
    each after a different sibling, must get the chain's logits."""
    past, root, child, other = [1, 2, 3], 4, 5, 6

    # Each call is evaluated before the next, as the loops do: a pipeline's ranks exchange hidden
    # states, and two pending passes of one shape could swap their messages.
    def run(tokens: list, cache) -> mx.array:
        logits = model(mx.array([tokens], mx.int32), cache=cache.layers)[0]
        mx.eval(logits)
        return logits

    def chain(tokens: list) -> mx.array:
        cache = make_cache(model)
        run(past, cache)
        return run([root] + tokens, cache)

    want = chain([child, other])
    cache = make_cache(model)
    run(past, cache)
    # nodes: other (depth 1), child (depth 1), other under child (depth 2)
    parents = [-1, -1, 1]
    cache.prepare([4], 4, layouts=[layout(1, parents, 4)])
    got = run([root, other, child, other], cache)
    cache.finalize()
    scale = mx.abs(want).max() + 1e-6
    gaps = [
        mx.abs(got[0] - want[0]).max() / scale,  # the root
        mx.abs(got[2] - want[1]).max() / scale,  # child: its own position, not after `other`
        mx.abs(got[3] - want[2]).max() / scale,  # other under child: depth 2
    ]
    return max(gap.item() for gap in gaps) < 1e-3


def enable_trees(model) -> bool:
    """Let ``model`` verify draft trees: a ``TreeRope`` around each rope module (in place, once;
    chains score as before), checked by a tree pass. False: it drafts chains (logged once)."""
    known = model.__dict__.get("_verifies_trees")
    if known is None:
        cache, known = make_cache(model), False
        if cache.takes_trees():
            try:
                _wrap_ropes(model, {})
                known = _probe(model)
            except Exception:  # a model that builds positions its own way refuses a (B, T) offset
                known = False
        model.__dict__["_verifies_trees"] = known
        if not known:
            why = _why_not(cache)
            logging.warning("draft trees: %s drafts chains (%s)", architecture(model), why)
    return known


def max_nodes_for(model, tree_nodes) -> Optional[int]:
    """A row's ``max_nodes`` for ``tree_nodes`` (0, ``"auto"`` or a count); None: chains."""
    if not tree_nodes:
        return None
    known = model.__dict__.get("_verifies_trees")
    if known is None:
        raise ValueError(
            f"tree_nodes={tree_nodes!r} needs the model's rope modules wrapped for trees: call "
            "decoder.enable_trees(model) once first"
        )
    return (0 if tree_nodes == "auto" else int(tree_nodes)) if known else None


def _why_not(cache) -> str:
    if not cache.takes_trees():
        others = sorted({type(layer).__name__ for layer in layers_of(cache.layers)} - {"KVRows"})
        return f"its cache has {', '.join(others)} layers beside attention"
    return "its attention does not take its positions and mask from the rope and cache alone"
