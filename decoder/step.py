"""One verification step for one row or many (``verify_step``): the target's pass over each row's
pending tokens and draft (``verify_pass``), the rows' processors and constraint masks, the step's
one host sync, each row's accept rule (``decoder.accept``), and the cache cut back to what each row
accepted. A row's failure is its result, the exception that ends it: it never fails the others.
``generate_step`` runs the step for one row, ``batch.BatchGenerator`` for many.
"""

from typing import NamedTuple, Optional, Sequence

import mlx.core as mx

from .cache import Cache
from .constrain import check_masks, mask_logits
from .draft import Draft
from .pass_cost import PassCost
from .tree import layout


class Step(NamedTuple):
    """What one step decided for each row."""

    results: list  # per row: (num_accepted, next_token), or the exception that ends the row
    drafts: list  # per row: the draft verified, its plan's cut to the step's width
    logits: mx.array  # (rows, width, vocab): the scores the rows accepted by (processed, masked)
    pass_width: int  # the positions the pass fed each row: pending tokens and draft, padded


def verify_step(
    model,
    cache: Cache,
    rows: Sequence,
    plans: Sequence,
    width: int,
    cost: PassCost,
    slots: Optional[Sequence[int]] = None,
) -> Step:
    """Verify each row's ``plan.draft``, cut to ``width - 1`` tokens, in one pass over ``cache``
    (row b in cache row ``slots[b]``, default b) and keep what each row accepts; ``cost`` times
    the pass once the step's host sync has waited for it."""
    drafts = [plan.draft.truncate(width - 1) for plan in plans]
    slots = range(len(rows)) if slots is None else slots
    started = cost.clock()
    logits, pass_width = verify_pass(model, cache, rows, drafts, width, slots)
    logits, failures = _process(rows, drafts, logits)
    # A lone sampled row reads no argmax: its own draws sync the pass, one sync fewer, and time it.
    # A batch's rows draw one by one, after the pass is timed.
    reads_argmax = len(rows) > 1 or rows[0].greedy
    scores = _score(logits, [plan.masks for plan in plans], width, failures, reads_argmax)
    if reads_argmax:
        cost.record(cost.clock() - started, width=pass_width, rows=cache.rows)
    results = _accept(rows, drafts, scores)
    if not reads_argmax:
        cost.record(cost.clock() - started, width=pass_width, rows=cache.rows)
    _keep_accepted(cache, rows, drafts, results, pass_width, slots)
    return Step(results, drafts, scores.logits, pass_width)


def verify_pass(
    model, cache: Cache, rows: Sequence, drafts: Sequence[Draft], width: int, slots: Sequence[int]
) -> tuple:
    """One pass of the target over each row's ``pending + draft``, right-padded to the longest.

    Args:
        cache: holds row b in cache row ``slots[b]``; the rows no row uses are fed padding.
        width: how many positions of each row to score: its last pending token and its draft.

    Returns:
        ``(logits, pass_width)``: lazy logits ``(len(rows), width, vocab)``.
    """
    pending = [row.pending for row in rows]
    fed = [len(tokens) + len(draft.tokens) for tokens, draft in zip(pending, drafts)]
    pass_width = max(fed)
    inputs, lengths = [[0] * pass_width for _ in range(cache.rows)], [1] * cache.rows
    for slot, tokens, draft, count in zip(slots, pending, drafts, fed):
        inputs[slot], lengths[slot] = tokens + draft.tokens + [0] * (pass_width - count), count
    if any(draft.tokens for draft in drafts):
        cache.checkpoint()
    layouts = None
    if any(draft.parents is not None for draft in drafts):
        layouts = [layout(1, None, pass_width)] * cache.rows  # a chain's (causal) for the rest
        for slot, tokens, draft in zip(slots, pending, drafts):
            layouts[slot] = layout(len(tokens), draft.parents, pass_width)
    cache.prepare(lengths, pass_width, layouts)
    logits = model(mx.array(inputs, mx.int32), cache=cache.layers)
    cache.finalize()
    if cache.rows > len(rows):
        logits = logits[mx.array(list(slots), mx.int32)]
    # each row's draft positions start after its pending tokens
    if any(len(tokens) > 1 for tokens in pending):
        positions = mx.minimum(
            mx.array([len(p) - 1 for p in pending], mx.int32)[:, None] + mx.arange(width),
            pass_width - 1,
        )
        logits = mx.take_along_axis(logits, positions[..., None], axis=1)
    return logits, pass_width


class _Scores(NamedTuple):
    """A pass's logits, masked where a row has a constraint, and what the host read of them."""

    logits: mx.array  # (B, W, vocab)
    failures: list  # per row: None, or the error that ends it before it accepts
    constrained: list  # per row: whether its masks were applied
    allowed: Optional[mx.array]  # (B, W, vocab) masks; None when no row is constrained
    argmax: Optional[list]  # per row and position (None: not read, a lone sampled row)
    argmax_allowed: Optional[list]  # per row and position: whether the constraint allows it


def _process(rows: Sequence, drafts: Sequence[Draft], logits: mx.array) -> tuple:
    """``(logits, failures)``: each row's logits through its processors (``Row.process``); a row
    whose processors raise keeps its logits and fails alone."""
    failures = [None] * len(rows)
    if not any(row.logits_processors for row in rows):
        return logits, failures
    processed = []
    for index, (row, draft) in enumerate(zip(rows, drafts)):
        try:
            processed.append(row.process(logits[index], draft))
        except Exception as error:  # noqa: BLE001 - the row's own processors; the others go on
            failures[index] = error
            processed.append(logits[index])
    return _stack(processed), failures


def _score(
    logits: mx.array, masks: list, width: int, failures: list, reads_argmax: bool
) -> _Scores:
    """Apply each row's constraint masks to its logits and, ``reads_argmax``, read every row's
    argmax to the host (and whether the masks allow it): the step's one host sync."""
    failures = list(failures)
    for index, row_masks in enumerate(masks):
        if row_masks is not None and failures[index] is None:
            try:
                check_masks(row_masks, logits.shape[-1])
            except ValueError as error:
                failures[index] = error
    masks = [m if failure is None else None for m, failure in zip(masks, failures)]
    constrained = [row_masks is not None for row_masks in masks]
    allowed = argmax_allowed = None
    if any(constrained):
        everything = mx.ones((width, logits.shape[-1]), mx.bool_)
        allowed = _stack([everything if m is None else _pad_rows(m, width) for m in masks])
        masked = mask_logits(logits, allowed)
        if not all(constrained):  # the others' logits as they were
            masked = mx.where(mx.array(constrained, mx.bool_)[:, None, None], masked, logits)
        logits = masked
    if not reads_argmax:
        return _Scores(logits, failures, constrained, allowed, None, None)
    argmax = mx.argmax(logits, axis=-1)
    if allowed is not None:
        argmax_allowed = mx.take_along_axis(allowed, argmax[..., None], -1)[..., 0]
    # The sync: the greedy rows' decisions, and every row's logits with them.
    mx.eval(argmax, argmax_allowed)
    argmax_allowed = None if argmax_allowed is None else argmax_allowed.tolist()
    return _Scores(logits, failures, constrained, allowed, argmax.tolist(), argmax_allowed)


def _accept(rows: Sequence, drafts: Sequence[Draft], scores: _Scores) -> list:
    """Per row: ``(num_accepted, next_token)`` by the row's own rule (``Row.accept``), or the
    exception that ends it."""
    results = list(scores.failures)
    for index, (row, draft) in enumerate(zip(rows, drafts)):
        if results[index] is None:
            argmax = None if scores.argmax is None else scores.argmax[index]
            try:
                results[index] = row.accept(
                    scores.logits[index, : len(draft.tokens) + 1], draft, argmax
                )
            except Exception as error:  # noqa: BLE001 - a row's sampler fails that row alone
                results[index] = error
    if scores.allowed is not None:
        _check_allowed(rows, results, scores)
    return results


def _check_allowed(rows: Sequence, results: list, scores: _Scores):
    """The target's own token is forbidden only when no allowed token had a usable score (the
    argmax or sample of an all -inf row): that row fails with a ConstraintError."""
    verdicts, unread = {}, []
    for index, result in enumerate(results):
        if scores.constrained[index] and not isinstance(result, Exception):
            position, token = rows[index].scored_at, result[1]  # after a tree's path
            if scores.argmax is not None and token == scores.argmax[index][position]:
                verdicts[index] = scores.argmax_allowed[index][position]
            else:
                unread.append(index)
    if unread:  # a sampled token other than the argmax (or no argmax read): ask its mask
        found = scores.allowed[
            mx.array(unread, mx.int32),
            mx.array([rows[i].scored_at for i in unread], mx.int32),
            mx.array([results[i][1] for i in unread], mx.int32),
        ].tolist()
        verdicts.update(zip(unread, found))
    for index, fine in verdicts.items():
        if not fine:
            results[index] = rows[index].forbidden(results[index][0])


def _keep_accepted(
    cache: Cache,
    rows: Sequence,
    drafts: Sequence[Draft],
    results: list,
    pass_width: int,
    slots: Sequence[int],
):
    """Each row keeps the tokens it accepted (``Row.commit``): a tree's path moved into place and
    the rest trimmed, or, where a recurrent layer cannot drop a rejected token, its checkpoint
    restored. A failed row, and a cache row no row uses, keep one token."""
    trims, kept, restored = [pass_width - 1] * cache.rows, [None] * cache.rows, []
    for row, draft, slot, result in zip(rows, drafts, slots, results):
        if not isinstance(result, Exception):
            kept[slot] = row.kept(draft)  # before commit, which moves the row's cached count
            trims[slot], restore = row.commit(cache, pass_width, len(draft.tokens), result[0])
            restored += [slot] if restore else []
    cache.compact(pass_width, kept)
    cache.rewind(trims, restored)


def _pad_rows(masks: mx.array, width: int) -> mx.array:
    """Masks for the first len(masks) positions; the padded positions' scores are never read."""
    if masks.shape[0] >= width:
        return masks[:width]
    return mx.concatenate([masks, mx.ones((width - masks.shape[0], masks.shape[1]), mx.bool_)])


def _stack(arrays: list) -> mx.array:
    """``mx.stack``, without a copy for one row."""
    return arrays[0][None] if len(arrays) == 1 else mx.stack(arrays)
