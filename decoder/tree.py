"""Draft trees: several candidate continuations of a row verified in one pass (SpecInfer, EAGLE-2),
on any attention model mlx-lm builds. A tree is a ``Draft`` whose tokens name their parents. A node
sees only its ancestors through the cache layer's mask (``KVRows.make_mask``, which mlx-lm's
``create_attention_mask`` asks), at its depth's position through the model's own rope modules
(``TreeRope``: the offset is ``(B, T)``, the T tokens move into the batch axis). After the pass the
accepted path moves into consecutive slots (``KVRows.compact``). docs/draft_trees.md.
"""

import logging
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from .cache import architecture, layers_of, make_cache
from .draft import Draft, constrain_draft


def depths(parents: Sequence[int]) -> list:
    """Each node's depth: 1 for a child of the last held token."""
    result = []
    for parent in parents:
        result.append(1 if parent < 0 else result[parent] + 1)
    return result


def is_chain(parents: Optional[Sequence[int]]) -> bool:
    return parents is None or all(parent == i - 1 for i, parent in enumerate(parents))


def path_to(parents: Sequence[int], node: int) -> list:
    """The nodes from the root's child down to ``node``."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def layout(num_pending: int, parents: Optional[Sequence[int]], width: int) -> tuple:
    """``(depth, visible)`` of a row's ``width`` pass slots: its pending tokens, its draft's nodes,
    then padding. ``depth[j]``: slot j's position past the row's first fed token; ``visible[j][k]``:
    whether slot j sees slot k (its pending tokens, its ancestors and itself)."""
    num_nodes = 0 if parents is None else len(parents)
    node_depths = depths(parents) if parents is not None else []
    depth = list(range(num_pending)) + [num_pending - 1 + d for d in node_depths]
    depth += list(range(len(depth), width))
    visible = [[k <= j for k in range(width)] for j in range(num_pending)]
    for node in range(num_nodes):
        seen = [k < num_pending for k in range(width)]
        for ancestor in path_to(parents, node):
            seen[num_pending + ancestor] = True
        visible.append(seen)
    for j in range(num_pending + num_nodes, width):  # padding sees what comes before it
        visible.append([k <= j for k in range(width)])
    return depth, visible


def kept_slots(num_pending: int, path: Sequence[int]) -> list:
    """The pass slots a row keeps, in order: its pending tokens and its accepted path."""
    return list(range(num_pending)) + [num_pending + node for node in path]


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
    name = type(module).__name__.lower()
    return isinstance(module, nn.RoPE) or "rope" in name or "rotary" in name


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


def supports_trees(model, cache) -> bool:
    """Whether ``model`` (with this ``Cache``'s kinds) can verify trees: its ropes wrapped, a tree
    pass scores as chain passes do (checked once per model)."""
    if not cache.takes_trees():
        return False
    known = model.__dict__.get("_verifies_trees")
    if known is None:
        try:
            _wrap_ropes(model, {})
            known = _probe(model)
        except Exception:  # a model that builds positions its own way refuses a (B, T) offset
            known = False
        model.__dict__["_verifies_trees"] = known
    return known


def leaves(parents: Sequence[int]) -> list:
    """The nodes with no children, in index order."""
    children = children_of(parents)
    return [node for node in range(len(parents)) if node not in children]


def children_of(parents: Sequence[int]) -> dict:
    """Node -> its children in index order (-1: the root's)."""
    children = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    return children


def accept_tree(
    logits: mx.array, draft, sampling, argmax: Optional[list] = None, key=None
) -> tuple:
    """``(path, next_token)`` for a tree draft and the target's ``(1 + nodes, vocab)`` logits
    (position 0: the row's last token; 1 + i: node i): the accepted nodes from the root down, and
    the target's token after the last of them.

    Greedy: follow the child equal to the argmax. Sampling (SpecInfer's multi-candidate rule for
    point masses): at each node try its children in turn; child c is accepted with probability
    r(c), where r is p with the children tried so far removed and renormalized; if none is, draw
    from r. Each step's token therefore follows p, as a chain's does. ``key``: the draws' random
    key (None: MLX's global stream).
    """
    parents, children = draft.parents, children_of(draft.parents)
    if sampling.temp == 0:
        if argmax is None:  # one sync per step: the walk reads the argmax on the host
            argmax = mx.argmax(logits, axis=-1).tolist()
        path, node = [], -1
        while True:
            match = [c for c in children.get(node, []) if draft.tokens[c] == argmax[node + 1]]
            if not match:
                return path, argmax[node + 1]
            node = match[0]
            path.append(node)
    p = sampling.probs(logits)
    # Every edge's p(child | parent) and a uniform draw for it, in the step's first sync.
    edges = p[
        mx.array([parent + 1 for parent in parents], mx.int32), mx.array(draft.tokens, mx.int32)
    ]
    uniform_key, draw_key = (None, None) if key is None else mx.random.split(key)
    uniforms = mx.random.uniform(shape=edges.shape, key=uniform_key)
    edge_probs, uniforms = mx.stack([edges, uniforms]).tolist()
    path, node = [], -1
    while True:
        child, rejected = _walk(children, draft.tokens, edge_probs, uniforms, node)
        if child is None:
            residual = p[node + 1]
            if rejected:
                residual = residual.at[mx.array(rejected, mx.int32)].multiply(0.0)
            # Float error can leave nothing where the rejected children held all the mass.
            residual = mx.where(residual.sum() > 0, residual, p[node + 1])
            return path, mx.random.categorical(mx.log(residual), key=draw_key).item()
        node = child
        path.append(node)


def _walk(children: dict, tokens: list, edge_probs: list, uniforms: list, node: int) -> tuple:
    """``(child, rejected)``: the child of ``node`` accepted (None: none) and the tokens rejected
    before it. Child c is accepted when u * (1 - the rejected siblings' p) < p(c), which is
    probability r(c) for r the renormalized rest of p."""
    remaining, rejected = 1.0, []
    for child in children.get(node, []):
        token = tokens[child]
        if token in rejected:  # a repeated candidate has nothing left to win
            continue
        if uniforms[child] * remaining < edge_probs[child]:
            return child, rejected
        remaining -= edge_probs[child]
        rejected.append(token)
    return None, rejected


def max_nodes_for(model, cache, tree_nodes) -> Optional[int]:
    """A row's ``max_nodes`` for the ``tree_nodes`` asked (0: chains, ``"auto"``, or a count):
    None where the model cannot verify trees, which says so once."""
    if not tree_nodes:
        return None
    if not supports_trees(model, cache):
        if not model.__dict__.get("_said_no_trees"):
            model.__dict__["_said_no_trees"] = True
            logging.warning(
                "draft trees: %s drafts chains (%s)", architecture(model), _why_not(cache)
            )
        return None
    return 0 if tree_nodes == "auto" else int(tree_nodes)


def _why_not(cache) -> str:
    if not cache.takes_trees():
        others = sorted({type(layer).__name__ for layer in layers_of(cache.layers)} - {"KVRows"})
        return f"its cache has {', '.join(others)} layers beside attention"
    return "its attention does not take its positions and mask from the rope and cache alone"


def select(draft, nodes: Sequence[int]):
    """The tree of ``draft``'s ``nodes`` (closed under parents, in index order), renumbered."""
    index = {node: i for i, node in enumerate(nodes)}
    parents = [index.get(draft.parents[node], -1) for node in nodes]
    chances = None if draft.chances is None else [draft.chances[node] for node in nodes]
    return Draft(
        [draft.tokens[node] for node in nodes],
        expected_speedup=draft.expected_speedup,
        parents=parents,
        chances=chances,
    )


def _walk_leaves(constraint, draft, with_masks: bool) -> tuple:
    """``(allowed, rows)``: the nodes the constraint allows after the accepted text (each walked
    along its own path, from its leaf) and, ``with_masks``, the mask of the tokens allowed after
    each position (0: the row's last token; 1 + i: node i)."""
    allowed, rows = set(), {}
    for leaf in leaves(draft.parents):
        path = path_to(draft.parents, leaf)
        states = constraint.walk(draft.path_tokens(path))
        allowed.update(path[: len(states) - 1])
        if with_masks:
            masks = constraint.masks(states)
            rows[0] = masks[0]
            rows.update(
                (node + 1, masks[depth + 1]) for depth, node in enumerate(path[: len(states) - 1])
            )
    if with_masks and not draft.tokens:
        rows[0] = constraint.masks(constraint.walk([]))[0]
    return sorted(allowed), rows


def _extend_leaves(draft, forced_after, max_depth: int):
    """``draft`` with the text forced after each leaf (``forced_after(path tokens)``) as a chain
    below it, no deeper than ``max_depth``; forced nodes take their leaf's chance."""
    tokens, parents = list(draft.tokens), list(draft.parents)
    chances = None if draft.chances is None else list(draft.chances)
    node_depths = depths(draft.parents)
    for leaf in leaves(draft.parents):
        forced = forced_after(draft.path_tokens(path_to(draft.parents, leaf)))
        parent = leaf
        for token in forced[: max_depth - node_depths[leaf]]:
            tokens.append(token)
            parents.append(parent)
            if chances is not None:
                chances.append(chances[leaf])
            parent = len(tokens) - 1
    return Draft(tokens, None, draft.expected_speedup, parents, chances)


def constrain_tree(constraint, draft, forced_after=None, max_depth: int = 0) -> tuple:
    """``(draft, allowed)`` for a tree: the nodes ``constraint`` allows (a forbidden node goes with
    its subtree) and the ``(1 + nodes, vocab)`` masks of the positions the target scores. Each
    node's state is its own path's: the protocol's ``walk`` and ``masks`` follow each leaf's path
    from the accepted text. ``forced_after(path tokens)``: the text the constraint forces after a
    leaf, drafted as a chain below it, at most ``max_depth`` deep."""
    draft = select(draft, _walk_leaves(constraint, draft, with_masks=False)[0])
    if not draft.tokens:  # every node forbidden: the text the constraint forces, as a chain
        forced = [] if forced_after is None else forced_after([])[:max_depth]
        return constrain_draft(constraint, Draft(forced))
    if forced_after is not None:
        draft = _extend_leaves(draft, forced_after, max_depth)
    nodes, rows = _walk_leaves(constraint, draft, with_masks=True)
    draft = select(draft, nodes)  # a forced token a split made the constraint refuse
    # renumbered rows: position 0, then the kept nodes'
    allowed = mx.stack([rows[0]] + [rows[node + 1] for node in nodes])
    if is_chain(draft.parents):
        draft.parents = None
    return draft, allowed
