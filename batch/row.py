"""A row of the batch (``BatchRow``, a ``decoder.row.Row`` with what the batch keeps of it), what a
step tells of it (``RowResponse``), and how ``insert``'s options become rows (``new_rows``,
``per_row``, ``check_row``) and which of them share a prompt (``shared_prompts``)."""

import traceback
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

from batch.policy import Acceptance
from decoder.cache import CachedPrefix
from decoder.row import DecodingStats, Row

# insert's per-row options, each one value for every prompt or one per prompt
OPTIONS = ("constraint", "sampling", "sampler", "max_tokens", "logprobs", "seed")


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
    """A ``decoder.row.Row`` in the batch: its uid, what it asked for, its drafts' acceptance."""

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
        of each node, else the rate its source's tokens are accepted at."""
        if plan.draft.chances is not None:
            return plan.draft.chances
        return self.acceptance.rate(plan.source.name) if plan.source else 0.0

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


def new_rows(
    prompts: Sequence[Sequence[int]],
    others: Sequence[BatchRow],
    uids: Iterator[int],
    eos: set,
    max_nodes: Optional[int],
    draft_sources,
    logits_processors,
    prompt_cache,
    options: tuple,
) -> list:
    """``BatchGenerator.insert``'s prompts as rows, each taking its uid from ``uids`` and its value
    of each option (``per_row``), checked (``check_row``). ``others``: the rows already in the
    batch, whose sources and constraints no new row may share; ``options``: the values of
    ``OPTIONS``."""
    count = len(prompts)
    processors = [[] for _ in prompts] if logits_processors is None else logits_processors
    if len(processors) != count or not all(isinstance(p, (list, tuple)) for p in processors):
        raise ValueError(
            f"logits_processors needs one list of processors per prompt ({count} lists)"
        )
    draft_sources = [[] for _ in prompts] if draft_sources is None else list(draft_sources)
    if len(draft_sources) != count or not all(isinstance(s, (list, tuple)) for s in draft_sources):
        raise ValueError(f"draft_sources needs one list of sources per prompt ({count} lists)")
    values = [per_row(name, value, count) for name, value in zip(OPTIONS, options)]
    names = OPTIONS + ("logits_processors", "prompt_cache")
    values.append([list(p) for p in processors])
    values.append(
        [None] * count if prompt_cache is None else per_row("prompt_cache", prompt_cache, count)
    )
    owned = [id(o) for row in others for o in row.sources + [row.constraint] if o is not None]
    rows = []
    for prompt, sources, *row_values in zip(prompts, draft_sources, *values):
        row_options = dict(zip(names, row_values))
        check_row(prompt, row_options)
        for stateful in list(sources) + [row_options["constraint"]]:
            if stateful is not None and id(stateful) in owned:
                raise ValueError(
                    f"{type(stateful).__name__} object is given to two rows: each row needs its own"
                )
            owned.append(id(stateful))
        row = BatchRow(
            next(uids),
            prompt,
            row_options.pop("prompt_cache"),
            row_options.pop("logprobs"),
            eos_token_ids=eos,
            draft_sources=sources,
            max_nodes=max_nodes if sources else None,
            **row_options,
        )
        rows.append(row)
    return rows


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
    logprobs = options["logprobs"]
    if logprobs is not None and logprobs < 0:
        raise ValueError(f"logprobs must be None or >= 0 (top tokens per position), got {logprobs}")
