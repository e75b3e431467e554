"""A row of the batch (``BatchRow``, a ``step.Row`` with what the batch keeps of it), what a
step tells of it (``RowResponse``), and how ``insert``'s options become rows (``per_row``,
``check_row``, ``shared_prompts``)."""

import traceback
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from batch.policy import Acceptance
from decoder.cache import CachedPrefix
from decoder.step import DecodingStats, Row


@dataclass
class RowResponse:
    uid: int
    tokens: list  # emitted this step (several when a draft was accepted)
    sources: list  # the source of each token: a draft source's name or TARGET
    finish_reason: Optional[str] = None  # "stop", "length" or "error"; None while the row runs
    error: Optional[str] = None  # one line, when finish_reason is "error"
    stats: Optional[DecodingStats] = None  # the row's own counts, on its last response
    # With keep_caches, on the last response: a cache.CachedPrefix of the
    # row's first n tokens (prompt and output), for a later prompt that extends them.
    cache: Optional[CachedPrefix] = None
    logprobs: Optional[list] = None  # with insert(logprobs=k): a TokenLogprobs per token in tokens
    trace: Optional[str] = None  # when finish_reason is "error": its traceback, for a log


class BatchRow(Row):
    """A ``step.Row`` in the batch: its uid, what it asked for, and its drafts' acceptance."""

    def __init__(
        self,
        uid: int,
        prompt: list,
        prompt_cache: Optional[CachedPrefix] = None,
        logprobs: Optional[int] = None,
        **options,
    ):
        super().__init__(prompt, **options)
        self.uid = uid
        self.prompt_cache = prompt_cache  # the cache of a prefix of the prompt, until prefilled
        self.logprobs = logprobs  # report logprobs and this many top tokens per emitted token
        self.acceptance = Acceptance()  # what the width policy expects of its drafts

    def expects(self, plan) -> Union[float, list]:
        """What the width policy expects of the row's draft (``choose_width``): a tree's chances
        of each node, else the rate its drafter's tokens are accepted at."""
        if plan.draft.chances is not None:
            return plan.draft.chances
        return self.acceptance.rate(plan.drafter.name) if plan.drafter else 0.0

    def failed(self, error: Exception) -> RowResponse:
        """The row's last response when ``error`` ends it (the other rows go on): one line naming
        it, and its traceback."""
        message = " ".join(str(error).split()) or type(error).__name__
        return RowResponse(
            self.uid,
            [],
            [],
            "error",
            f"{type(error).__name__}: {message}",
            self.stats,
            trace=trace_of(error),
        )


def trace_of(error: BaseException) -> str:
    """``error``'s traceback as Python prints it (for a log: ``RowResponse.trace``)."""
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


def per_row(name: str, value, count: int) -> list:
    """``insert``'s option ``value``: one per prompt, given as a list or one for all."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(
                f"{name} has {len(value)} entries for {count} prompts: "
                "give one value or one per prompt"
            )
        return list(value)
    return [value] * count


def shared_prompts(rows: Sequence[BatchRow]) -> tuple:
    """``(firsts, copies)``: the first row of each distinct prompt (with the same cached prefix
    length), and for each row the index in ``firsts`` of the one whose prefill it copies (a
    request's ``n`` choices, or identical requests joining together)."""
    firsts, copies, seen = [], [], {}
    for index, row in enumerate(rows):
        cached = 0 if row.prompt_cache is None else row.prompt_cache.length
        key = (tuple(row.tokens[:-1]), cached)
        if key not in seen:
            seen[key] = len(firsts)
            firsts.append(index)
        copies.append(seen[key])
    return firsts, copies


def check_row(prompt: list, options: dict):
    """Refuse a row's bad options in one sentence."""
    if len(prompt) == 0:
        raise ValueError("a prompt is empty: give at least one token")
    if options["max_tokens"] < 1:
        raise ValueError(f"max_tokens must be at least 1, got {options['max_tokens']}")
    options["sampling"].check()
    logprobs = options["logprobs"]
    if logprobs is not None and logprobs < 0:
        raise ValueError(f"logprobs must be None or >= 0 (top tokens per position), got {logprobs}")
