"""mlx-lm's logits processors over every position of a verify pass at once (``process_logits``):
position j sees the context and the first j draft tokens. Those made here
(``make_logits_processors``) take a few array operations for all W positions; any other callable
is called once per position. Each position gets mlx-lm's result bit for bit."""

from typing import Callable, Dict, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import (
    make_frequency_penalty,
    make_presence_penalty,
    make_repetition_penalty,
)


class PositionProcessor:
    """A logits processor as mlx-lm calls it (``processor(tokens, logits)``, the logits of the
    position after ``tokens``) that also processes the W positions of a pass at once."""

    @staticmethod
    def of(processor: Callable) -> "PositionProcessor":
        """``processor`` itself if made here, else a wrapper that calls it once per position."""
        return processor if isinstance(processor, PositionProcessor) else _EachPosition(processor)

    def over_positions(self, context: list, first: int, logits: mx.array) -> mx.array:
        """``logits`` (W, vocab): row j is the position after ``context[:first + j]``."""
        raise NotImplementedError

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        # mlx-lm's loops pass an array: its values on the host (one sync, outside our loops)
        return self.over_positions(tokens.tolist(), len(tokens), logits)


class _EachPosition(PositionProcessor):
    def __init__(self, processor: Callable):
        self.processor = processor

    def over_positions(self, context, first, logits):
        tokens = mx.array(context, mx.int32)
        rows = [
            self.processor(tokens[: first + j], logits[j : j + 1]) for j in range(logits.shape[0])
        ]
        return mx.concatenate(rows, axis=0)


class LogitBias(PositionProcessor):
    def __init__(self, logit_bias: Dict[int, float]):
        self.indices = mx.array(list(logit_bias.keys()), mx.int32)
        self.values = mx.array(list(logit_bias.values()), mx.float32)

    def over_positions(self, context, first, logits):
        return logits.at[:, self.indices].add(self.values)  # mlx-lm's op, on every row at once


class _Penalty(PositionProcessor):
    """A penalty on the last ``context_size`` tokens before each position (0: all), counted on
    the host, applied with one gather and one scatter (``penalize``: where a count is > 0); a
    pass of one position calls mlx-lm's own (``made_by``)."""

    made_by = None  # mlx-lm's factory of the same penalty, for one position

    def __init__(self, penalty: float, context_size: int = 20):
        self.penalty, self.context_size = penalty, context_size
        self.alone = type(self).made_by(penalty, context_size)

    def over_positions(self, context, first, logits):
        width, vocab = logits.shape
        ends = first + np.arange(width)  # position j sees context[:ends[j]]
        starts = np.maximum(ends - self.context_size, 0) if self.context_size else 0 * ends
        low = int(starts[0])
        if width == 1:  # a plain step: mlx-lm's own processor is quicker than counting
            return self.alone(mx.array(context[low:first], mx.int32), logits)
        span = np.asarray(context[low : first + width - 1], np.int64)
        rows = np.repeat(np.arange(width), ends - starts)
        if not len(rows):
            return logits  # no position has a token before it
        tokens = np.concatenate([span[s - low : e - low] for s, e in zip(starts, ends)])
        keys, counts = np.unique(rows * vocab + tokens, return_counts=True)
        rows, tokens = keys // vocab, keys % vocab
        # (W, K): each row's distinct tokens, padded with its first one (written twice, alike)
        per_row = np.bincount(rows, minlength=width)
        column = np.arange(len(keys)) - (np.cumsum(per_row) - per_row)[rows]
        ids = np.zeros((width, max(per_row.max(), 1)), np.int32)
        found = np.zeros(ids.shape, np.int32)
        ids[rows, column], found[rows, column] = tokens, counts
        padding = np.arange(ids.shape[1])[None] >= per_row[:, None]
        ids, found = np.where(padding, ids[:, :1], ids), np.where(padding, found[:, :1], found)
        ids = mx.array(ids, mx.int32)
        values = mx.take_along_axis(logits, ids, axis=-1)
        found_array = mx.array(found, mx.int32)
        penalized = self.penalize(values, found_array, int(found.max()))
        return mx.put_along_axis(logits, ids, mx.where(found_array > 0, penalized, values), -1)


class RepetitionPenalty(_Penalty):
    made_by = staticmethod(make_repetition_penalty)

    def __init__(self, penalty: float, context_size: int = 20):
        if penalty < 0 or not isinstance(penalty, (int, float)):
            raise ValueError(f"penalty must be a non-negative float, got {penalty}")
        super().__init__(penalty, context_size)

    def penalize(self, values, counts, most):
        return mx.where(values < 0, values * self.penalty, values / self.penalty)


class PresencePenalty(_Penalty):
    made_by = staticmethod(make_presence_penalty)

    def penalize(self, values, counts, most):
        return values - self.penalty


class FrequencyPenalty(_Penalty):
    made_by = staticmethod(make_frequency_penalty)

    def penalize(self, values, counts, most):
        # once per occurrence, one subtraction at a time, as mlx-lm's scatter subtracts
        for occurrence in range(most):
            values = mx.where(counts > occurrence, values - self.penalty, values)
        return values


def make_logits_processors(
    logit_bias: Optional[Dict[int, float]] = None,
    repetition_penalty: Optional[float] = None,
    repetition_context_size: Optional[int] = 20,
    presence_penalty: Optional[float] = None,
    presence_context_size: Optional[int] = 20,
    frequency_penalty: Optional[float] = None,
    frequency_context_size: Optional[int] = 20,
) -> list:
    """mlx-lm's ``make_logits_processors`` (the same arguments, defaults and order: the bias, then
    the repetition, presence and frequency penalties), as ``PositionProcessor``s."""
    processors = [LogitBias(logit_bias)] if logit_bias else []
    for kind, penalty, context_size in (
        (RepetitionPenalty, repetition_penalty, repetition_context_size),
        (PresencePenalty, presence_penalty, presence_context_size),
        (FrequencyPenalty, frequency_penalty, frequency_context_size),
    ):
        if penalty is not None and penalty != 0:
            processors.append(kind(penalty, context_size))
    return processors


def process_logits(
    processors: Sequence[Callable], tokens: list, draft_tokens: list, logits: mx.array
) -> mx.array:
    """The (len(draft_tokens) + 1, vocab) ``logits`` of a verify pass, each position through the
    processors with the tokens before it: ``tokens`` and the draft tokens ahead of the position."""
    if not processors:
        return logits
    context = list(tokens) + list(draft_tokens)
    for processor in processors:
        logits = PositionProcessor.of(processor).over_positions(context, len(tokens), logits)
    return logits
