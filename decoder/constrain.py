"""A constraint's masks on a draft, a chain (``constrain_draft``) or a tree (``constrain_tree``),
and the logits with forbidden tokens at -inf (``mask_logits``)."""

import mlx.core as mx

from .draft import Constraint, Draft
from .tree import depths, is_chain, leaves, path_to, select


def constrain_draft(constraint: Constraint, draft: Draft) -> tuple:
    """``(draft, allowed)``: the draft cut to what ``constraint`` allows and the masks of the
    positions the target scores. A q-draft keeps its first forbidden token, so the target rejects
    it and samples (p - q)+, which keeps sampling exact (docs/decoder.md)."""
    states = constraint.walk(draft.tokens)
    num_allowed = len(states) - 1
    allowed = constraint.masks(states)
    if num_allowed < len(draft.tokens):
        if draft.probs is None:
            draft = draft.truncate(num_allowed)
        else:
            draft = draft.truncate(num_allowed + 1)
            allowed = mx.concatenate([allowed, allowed[-1:]])
    return draft, allowed


def check_masks(allowed: mx.array, vocab_size: int):
    """Refuse a constraint built for another vocabulary than the model scores."""
    if allowed.shape[-1] != vocab_size:
        raise ValueError(
            f"the constraint masks {allowed.shape[-1]} tokens but the model scores "
            f"{vocab_size}: build it with this model's tokenizer and vocab_size"
        )


def mask_logits(logits: mx.array, allowed: mx.array) -> mx.array:
    """``logits`` with forbidden and NaN-scored tokens at -inf (a NaN must not win an argmax)."""
    check_masks(allowed, logits.shape[-1])
    return mx.where(allowed & ~mx.isnan(logits), logits, -mx.inf)


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


def _extend_leaves(constraint: Constraint, draft: Draft, max_depth: int) -> Draft:
    """``draft`` with the text ``constraint`` forces after each leaf (``forced_after``) as a chain
    below it, no deeper than ``max_depth``; forced nodes take their leaf's chance."""
    tokens, parents = list(draft.tokens), list(draft.parents)
    chances = None if draft.chances is None else list(draft.chances)
    node_depths = depths(draft.parents)
    for leaf in leaves(draft.parents):
        forced = constraint.forced_after(draft.path_tokens(path_to(draft.parents, leaf)))
        parent = leaf
        for token in forced[: max_depth - node_depths[leaf]]:
            tokens.append(token)
            parents.append(parent)
            if chances is not None:
                chances.append(chances[leaf])
            parent = len(tokens) - 1
    return Draft(tokens, None, draft.expected_speedup, parents, chances)


def constrain_tree(constraint: Constraint, draft: Draft, max_depth: int) -> tuple:
    """``(draft, allowed)`` for a tree: the nodes ``constraint`` allows (a forbidden node goes with
    its subtree) and the ``(1 + nodes, vocab)`` masks of the positions the target scores. Each
    node's state is its own path's: ``walk`` and ``masks`` follow each leaf's path from the
    accepted text. What it forces after a leaf is drafted below it, at most ``max_depth`` deep."""
    draft = select(draft, _walk_leaves(constraint, draft, with_masks=False)[0])
    if not draft.tokens:  # every node forbidden: the text the constraint forces, as a chain
        return constrain_draft(constraint, Draft(constraint.forced_after([])[:max_depth]))
    draft = _extend_leaves(constraint, draft, max_depth)
    nodes, rows = _walk_leaves(constraint, draft, with_masks=True)
    draft = select(draft, nodes)  # a forced token a split made the constraint refuse
    # renumbered rows: position 0, then the kept nodes'
    allowed = mx.stack([rows[0]] + [rows[node + 1] for node in nodes])
    if is_chain(draft.parents):
        draft.parents = None
    return draft, allowed
