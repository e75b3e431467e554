"""What one ``[B, W]`` pass (``decoder.row.verify_pass``) decides for each row: its constraint's
masks on its logits, the step's one host sync, and how far it accepts its draft (``Row.accept``).

A row's result is ``(num_accepted, next_token)`` or the exception that ends that row: one row's bad
masks, failed sampler or forbidden token never fail the others.
"""

from typing import NamedTuple, Optional

import mlx.core as mx

from decoder.constrain import check_masks, mask_logits


class Scores(NamedTuple):
    """A pass's logits, masked where a row has a constraint, and what the host read of them."""

    logits: mx.array  # (B, W, vocab)
    targets: list  # per row and position: the argmax (the greedy rows' decisions)
    failures: list  # per row: None, or the error of masks that failed their check
    constrained: list  # per row: whether its masks were applied
    allowed: Optional[mx.array]  # (B, W, vocab) masks; None when no row is constrained
    # (B, W): whether the constraint allows the argmax (evaluated)
    argmax_allowed: Optional[mx.array]


def score(logits: mx.array, plans: list, width: int) -> Scores:
    """Apply each row's masks (``plan.masks``) to its logits and read every row's argmax to the
    host."""
    failures, masks = [None] * len(plans), [plan.masks for plan in plans]
    for index, row_masks in enumerate(masks):
        if row_masks is not None:
            try:
                check_masks(row_masks, logits.shape[-1])
            except ValueError as error:
                failures[index], masks[index] = error, None
    constrained = [row_masks is not None for row_masks in masks]
    allowed = None
    if any(constrained):
        allowed = mx.stack(
            [
                mx.ones((width, logits.shape[-1]), mx.bool_)
                if row_masks is None
                else _pad_rows(row_masks, width)
                for row_masks in masks
            ]
        )
        logits = mx.where(
            mx.array(constrained, mx.bool_)[:, None, None], mask_logits(logits, allowed), logits
        )
    # The step's one host sync: the greedy rows' decisions (and whether the constraints allow
    # them), and every row's logits with them.
    argmax = mx.argmax(logits, axis=-1)
    argmax_allowed = (
        None if allowed is None else mx.take_along_axis(allowed, argmax[..., None], -1)[..., 0]
    )
    mx.eval(argmax, argmax_allowed)
    return Scores(logits, argmax.tolist(), failures, constrained, allowed, argmax_allowed)


def accept(rows: list, drafts: list, scores: Scores) -> list:
    """Per row: ``(num_accepted, next_token)`` by the row's own rules, or the exception that ends
    it."""
    results = list(scores.failures)
    for index, (row, draft) in enumerate(zip(rows, drafts)):
        if results[index] is None:
            try:
                results[index] = row.accept(
                    scores.logits[index, : len(draft.tokens) + 1], draft, scores.targets[index]
                )
            except Exception as error:  # noqa: BLE001
                results[index] = error
    if scores.allowed is not None:
        _check_allowed(rows, results, scores)
    return results


def _check_allowed(rows: list, results: list, scores: Scores):
    """The target's own token is forbidden only when no allowed token had a usable score (the
    argmax or sample of an all -inf row): that row fails with a ConstraintError."""
    argmax_allowed = scores.argmax_allowed.tolist()
    verdicts, sampled = {}, []
    for index, result in enumerate(results):
        if scores.constrained[index] and not isinstance(result, Exception):
            position, token = rows[index].scored_at, result[1]  # after a tree's path
            if token == scores.targets[index][position]:
                verdicts[index] = argmax_allowed[index][position]
            else:
                sampled.append(index)
    if sampled:  # a sampled token other than the argmax: ask its mask
        found = scores.allowed[
            mx.array(sampled, mx.int32),
            mx.array([rows[i].scored_at for i in sampled], mx.int32),
            mx.array([results[i][1] for i in sampled], mx.int32),
        ].tolist()
        verdicts.update(zip(sampled, found))
    for index, fine in verdicts.items():
        if not fine:
            results[index] = rows[index].forbidden(results[index][0])


def _pad_rows(masks: mx.array, width: int) -> mx.array:
    """Masks for the first len(masks) positions; the padded positions' scores are never read."""
    if masks.shape[0] >= width:
        return masks[:width]
    return mx.concatenate([masks, mx.ones((width - masks.shape[0], masks.shape[1]), mx.bool_)])
