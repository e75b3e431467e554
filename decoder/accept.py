"""How much of a draft the target accepts: greedy, the exact residual (Leviathan et al., 2023), an
mlx-lm sampler's draws, SpecInfer's rule for a tree; each emitted token follows p. ``accept_path``
picks the rule a row's settings and draft call for (``decoder.step`` runs it for every row)."""

from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.utils import common_prefix_len

from .draft import Draft
from .sampling import Sampling
from .tree import children_of


def accept_draft(
    logits: mx.array,
    draft: Draft,
    sampling: Sampling,
    key: Optional[mx.array] = None,
    argmax: Optional[list] = None,
) -> tuple:
    """``(num_accepted, next_token)`` for a draft and the target's (len(draft) + 1, vocab) logits;
    p is ``sampling.probs``. ``key``: an ``mx.random`` key the step's draws come from (None: MLX's
    global stream). ``argmax``: the logits' argmax per position, where the caller has it on the
    host already.

    Greedy: accept while the draft equals the argmax. Sampling (Leviathan et al., 2023): accept
    x ~ q with probability min(1, p(x) / q(x)), else draw from (p - q)+ / |(p - q)+|; a point mass
    has q(x) = 1. Either way the output follows p.
    """
    num_draft = len(draft.tokens)
    if sampling.temp == 0:
        if argmax is None:  # one sync per step: the accept decision needs the values on the host
            argmax = mx.argmax(logits, axis=-1).tolist()
        num_accepted = common_prefix_len(draft.tokens, argmax)
        return num_accepted, argmax[num_accepted]

    uniform_key, draw_key = (None, None) if key is None else mx.random.split(key)
    p = sampling.probs(logits)
    q = None if draft.probs is None else draft.probs.astype(mx.float32)
    num_accepted = 0
    if num_draft:
        positions, tokens = mx.arange(num_draft), mx.array(draft.tokens, mx.int32)
        p_draft = p[positions, tokens]
        q_draft = mx.ones_like(p_draft) if q is None else q[positions, tokens]
        # min(1, p/q) without dividing: accept when u * q < p.
        accepted = (
            mx.random.uniform(shape=(num_draft,), key=uniform_key) * q_draft < p_draft
        ).tolist()
        num_accepted = (accepted + [False]).index(False)
    if num_accepted == num_draft:
        next_probs = p[num_draft]
    else:
        rejected = draft.tokens[num_accepted]
        if q is None:
            residual = p[num_accepted].at[rejected].add(-1.0)
        else:
            residual = p[num_accepted] - q[num_accepted]
        residual = mx.maximum(residual, 0.0)
        # p == q exactly leaves nothing; then p itself is the right distribution.
        next_probs = mx.where(residual.sum() > 0, residual, p[num_accepted])
    next_token = mx.random.categorical(mx.log(next_probs), key=draw_key).item()
    return num_accepted, next_token


def accept_path(
    logits: mx.array,
    draft: Draft,
    sampling: Sampling,
    sampler: Optional[Callable] = None,
    argmax: Optional[list] = None,
    key: Optional[mx.array] = None,
) -> tuple:
    """``(path, next_token)``: the draft nodes accepted (of a chain, its first tokens) and the
    target's token after them, by the rule that fits: ``accept_tree``, ``accept_sampled`` for an
    mlx-lm ``sampler``, else ``accept_draft`` (``argmax`` and ``key`` as it takes them)."""
    if draft.parents is not None:
        return accept_tree(logits, draft, sampling, argmax, key)
    if sampler is not None:
        num_accepted, next_token = accept_sampled(logits, draft, sampler)
    else:
        num_accepted, next_token = accept_draft(logits, draft, sampling, key=key, argmax=argmax)
    return list(range(num_accepted)), next_token


def accept_sampled(logits: mx.array, draft: Draft, sampler: Callable) -> tuple:
    """``accept_draft`` for an mlx-lm sampler, as mlx-lm verifies: accept while the draft equals
    the sampler's draws at each position, so each emitted token is one of its draws."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    # One sync per step, as in the greedy branch of accept_draft.
    target = sampler(logprobs).tolist()
    num_accepted = common_prefix_len(draft.tokens, target)
    return num_accepted, target[num_accepted]


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
