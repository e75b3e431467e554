"""OpenAI's ``n``: several choices from one prompt, each its own row of the batch.

A request with ``n`` > 1 is queued as n requests (``choice_requests``) in one group
(``Engine.submit_together``): they join the batch in the same step when n rows are free, and the
batch prefills their one prompt once and copies its cache to each row
(``batch.row.shared_prompts``). Each choice is an ordinary request of the engine, so under a sharded
model every rank inserts the same rows in the same order, as for any other request.

Seeds: each row draws from its own random stream (``insert(seed=...)``), so choice i is what a
request with ``n`` 1 and seed ``(seed + i) % 2**64`` gives alone (where no draft model samples: a
draft model draws from MLX's global stream). Without a seed the choices draw from the global
stream. At temperature 0 every choice is the n=1 answer.

Each choice has its own format (its own tool-call reader, logprob offsets and finish_reason); the
answers are merged here: ``choices[i].index`` is i, ``prompt_tokens`` counts the prompt once and
``completion_tokens`` sums the choices'.
"""

import asyncio
from dataclasses import replace

from server.formats import usage
from server.request import GenerationRequest

DONE = "data: [DONE]\n\n"


def choice_requests(request: GenerationRequest) -> list:
    """The n requests the engine decodes for ``request``: choice i with seed ``seed + i``."""
    seed = request.seed
    return [
        replace(request, seed=None if seed is None else (seed + index) % 2**64)
        for index in range(request.num_choices)
    ]


def choice_formats(make_format, model_id: str, requests: list) -> list:
    """A format per choice, with its index and the first one's id; with n > 1 their streams leave
    the usage chunk and the end to ``choice_events``."""
    if len(requests) == 1:
        return [make_format(model_id, requests[0])]
    formats = []
    for index, request in enumerate(requests):
        fmt = make_format(model_id, replace(request, include_usage=False))
        fmt.index = index
        if formats:
            fmt.id, fmt.created = formats[0].id, formats[0].created
        formats.append(fmt)
    return formats


def merged_usage(usages: list) -> dict:
    """One usage for all the choices: the prompt once, the completions and drafts summed."""
    first = usages[0]
    completion = sum(u["completion_tokens"] for u in usages)
    decoding = ("target_forward_passes", "draft_proposed", "draft_accepted")
    return {
        **first,
        "completion_tokens": completion,
        "total_tokens": first["prompt_tokens"] + completion,
        "completion_tokens_details": {
            "reasoning_tokens": sum(
                u["completion_tokens_details"]["reasoning_tokens"] for u in usages
            )
        },
        "decoding": {
            **first["decoding"],
            **{key: sum(u["decoding"][key] for u in usages) for key in decoding},
        },
    }


def _usages(formats: list, outcomes: list) -> list:
    return [
        usage(outcome, fmt.reasoning_tokens(outcome)) for fmt, outcome in zip(formats, outcomes)
    ]


def full_answer(formats: list, outcomes: list) -> dict:
    """The JSON answer of every choice's outcome."""
    answers = [fmt.full(outcome) for fmt, outcome in zip(formats, outcomes)]
    if len(answers) == 1:
        return answers[0]
    return {
        **answers[0],
        "choices": [answer["choices"][0] for answer in answers],
        "usage": merged_usage(_usages(formats, outcomes)),
    }


async def choice_events(jobs: list, formats: list, cached: int, include_usage: bool):
    """The chunks of every choice as they come, each with its index; one usage chunk (if asked)
    and one end after the last choice. A choice's error ends the stream."""
    for fmt in formats:
        for event in fmt.start(cached):
            yield event
    outcomes = [None] * len(jobs)
    waiting = {asyncio.ensure_future(job.events.get()): i for i, job in enumerate(jobs)}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=waiting.get):
                index = waiting.pop(task)
                kind, payload = task.result()
                fmt = formats[index]
                if kind == "error":
                    for event in fmt.failed(payload):
                        yield event
                    return
                if kind == "text":
                    waiting[asyncio.ensure_future(jobs[index].events.get())] = index
                    events = fmt.text(*payload)
                else:
                    outcomes[index] = payload
                    events = [event for event in fmt.done(payload) if event != DONE]
                for event in events:
                    yield event
    finally:
        for task in waiting:
            task.cancel()
    if include_usage:
        yield formats[0].usage_event(merged_usage(_usages(formats, outcomes)))
    yield DONE
