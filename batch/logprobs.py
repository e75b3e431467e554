"""The target's log-probabilities of the tokens a batch step emits (``insert(..., logprobs=k)``).

Each emitted token gets its log-probability and its position's k most likely tokens, read off the
pass that verified it: a token has the same logprobs whether a source drafted it or the target
chose it.
"""

from typing import NamedTuple

import mlx.core as mx


class TokenLogprobs(NamedTuple):
    """The target's log-softmax at one emitted token's position (temperature 1, before top_p, as
    mlx_lm.server reports; under a constraint, of the masked distribution: forbidden tokens are
    -inf)."""

    logprob: float  # of the emitted token
    top_ids: list  # the k most likely tokens, most likely first
    top_logprobs: list


def token_logprobs(rows: list, drafts: list, results: list, logits: mx.array) -> list:
    """Per row: None, or for the rows that asked (``row.logprobs`` is k), a ``TokenLogprobs`` for
    each token it accepted this step and the target's next one, read off this pass's (masked) logits
    at their positions. ``results`` holds each row's ``(num_accepted, next_token)`` or its
    exception. Only the asking rows' positions are scored; one host sync, and none when no row
    asked."""
    asking = [
        i
        for i, (row, result) in enumerate(zip(rows, results))
        if row.logprobs is not None and not isinstance(result, Exception)
    ]
    found = [None] * len(results)
    if not asking:
        return found
    paths = [rows[i].path[: results[i][0]] for i in asking]
    chosen = [drafts[i].path_tokens(path) + [results[i][1]] for i, path in zip(asking, paths)]
    length = max(len(tokens) for tokens in chosen)
    # each token's position in the pass: the row's last token, then its accepted nodes
    positions = mx.array(
        [[0] + [1 + node for node in path] + [0] * (length - 1 - len(path)) for path in paths],
        mx.int32,
    )
    scores = mx.take_along_axis(logits[mx.array(asking, mx.int32)], positions[..., None], axis=1)
    scores = scores.astype(mx.float32)
    logprobs = scores - mx.logsumexp(scores, axis=-1, keepdims=True)
    ids = mx.array([tokens + [0] * (length - len(tokens)) for tokens in chosen], mx.int32)
    picked = mx.take_along_axis(logprobs, ids[..., None], -1)[..., 0]
    top = min(max(rows[i].logprobs for i in asking), logprobs.shape[-1])
    top_ids = mx.zeros((len(asking), length, 0), mx.int32)
    if top:
        top_ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[..., :top]
        order = mx.argsort(-mx.take_along_axis(logprobs, top_ids, -1), axis=-1)
        top_ids = mx.take_along_axis(top_ids, order, -1)
    top_values = mx.take_along_axis(logprobs, top_ids, -1)
    mx.eval(picked, top_ids, top_values)
    for index, tokens, row_picked, row_ids, row_values in zip(
        asking, chosen, picked.tolist(), top_ids.tolist(), top_values.tolist()
    ):
        k = rows[index].logprobs
        found[index] = [
            TokenLogprobs(row_picked[p], row_ids[p][:k], row_values[p][:k])
            for p in range(len(tokens))
        ]
    return found
