"""The target's distribution at each position: mlx-lm's logits processors with the tokens before
the position (``processors.process_logits``), then temperature and the truncations of mlx-lm's
``make_sampler`` as one distribution (``Sampling.probs``) that drafts are verified against
(docs/sampling.md)."""

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k


class SamplingError(ValueError):
    """A setting out of its range: ``setting`` names it, ``bound`` says what it must be."""

    def __init__(self, setting: str, bound: str, value):
        super().__init__(f"{setting} must be {bound}, got {value!r}")
        self.setting, self.bound = setting, bound


# Each setting's range and how a refusal says it; outside [1e-6, 1e6] logits / temp overflow.
RANGES = {
    "temp": (lambda v: v == 0 or 1e-6 <= v <= 1e6, "0 (greedy) or between 1e-6 and 1e6"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "min_tokens_to_keep": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "top_k": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0 (0: off)"),
    "xtc_probability": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "xtc_threshold": (lambda v: 0 <= v <= 0.5, "in [0, 0.5]"),
}


@dataclass(frozen=True)
class Sampling:
    """The target's sampling settings, with ``make_sampler``'s names and defaults (``top_p`` 1.0
    is off, as 0.0 is there); ``temp`` 0 is greedy and ignores the rest, as mlx-lm does. Checked
    when built (``SamplingError``): build it once from flags or a request and pass it along."""

    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    top_k: int = 0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_special_tokens: tuple = ()  # token ids XTC never removes

    def __post_init__(self):
        # hashable: rows that sample alike are grouped by it
        object.__setattr__(self, "xtc_special_tokens", tuple(self.xtc_special_tokens))
        for name, (fine, bound) in RANGES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not fine(value):  # a bool is no number here
                raise SamplingError(name, bound, value)

    def probs(self, logits: mx.array) -> mx.array:
        """Rows of ``logits`` -> the distribution a token is drawn from.

        ``min_p``, XTC's threshold and ``top_k`` read the distribution at temperature 1, as
        mlx-lm's sampler does; ``top_p`` reads it after temperature, as before. XTC removes,
        with probability ``xtc_probability``, every token above the threshold but the least
        likely of them: the result is the mixture of the two branches, which is exact.
        """
        # Every truncation reads ranks or ratios of probabilities, so unnormalized logits do.
        logprobs = logits = logits.astype(mx.float32)
        if self.top_p < 1.0:
            logprobs = mx.where(_top_p_keeps(logits / self.temp, self.top_p), logprobs, -mx.inf)
        if self.min_p > 0.0:
            logprobs = apply_min_p(logprobs, self.min_p, self.min_tokens_to_keep)
        plain = self._finish(logprobs)
        if self.xtc_probability <= 0.0:
            return plain
        removed = self._finish(mx.where(self._xtc_removes(logprobs), -mx.inf, logprobs))
        return (1.0 - self.xtc_probability) * plain + self.xtc_probability * removed

    def _finish(self, logprobs: mx.array) -> mx.array:
        if 0 < self.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, self.top_k)
        return mx.softmax(logprobs / self.temp, axis=-1)

    def _xtc_removes(self, logprobs: mx.array) -> mx.array:
        """mlx-lm's ``apply_xtc`` mask: the tokens above the threshold but the least likely one."""
        probs = mx.softmax(logprobs, axis=-1)
        above = mx.where(probs > self.xtc_threshold, probs, mx.inf)
        mask = probs > above.min(axis=-1, keepdims=True)
        if self.xtc_special_tokens:
            mask[..., list(self.xtc_special_tokens)] = False
        return mask


def _top_p_keeps(logits: mx.array, top_p: float) -> mx.array:
    """The smallest prefix of the tokens by probability whose mass reaches ``top_p`` (the top
    token always stays)."""
    probs = mx.softmax(logits, axis=-1)
    order = mx.argsort(-probs, axis=-1)
    sorted_probs = mx.take_along_axis(probs, order, axis=-1)
    keep_sorted = (mx.cumsum(sorted_probs, axis=-1) - sorted_probs) < top_p
    return mx.put_along_axis(mx.zeros(probs.shape, mx.bool_), order, keep_sorted, axis=-1)
