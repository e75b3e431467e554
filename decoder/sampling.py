"""The target's distribution at each position: mlx-lm's logits processors with the tokens before
the position (``processors.process_logits``), then temperature and the truncations of mlx-lm's
``make_sampler`` as one distribution (``Sampling.probs``) that drafts are verified against
(docs/sampling.md)."""

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k


@dataclass(frozen=True)
class Sampling:
    """The target's sampling settings, with ``make_sampler``'s names and defaults (``top_p`` 1.0
    is off, as 0.0 is there). ``temp`` 0 is greedy and ignores the rest, as mlx-lm does."""

    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    top_k: int = 0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_special_tokens: tuple = ()

    def check(self):
        """Refuse settings out of mlx-lm's ranges in one sentence naming the setting."""
        ranges = {
            "temp": self.temp >= 0,
            "top_p": 0 < self.top_p <= 1,
            "min_p": 0 <= self.min_p <= 1,
            "min_tokens_to_keep": isinstance(self.min_tokens_to_keep, int)
            and self.min_tokens_to_keep >= 1,
            "top_k": isinstance(self.top_k, int) and self.top_k >= 0,
            "xtc_probability": 0 <= self.xtc_probability <= 1,
            "xtc_threshold": 0 <= self.xtc_threshold <= 0.5,
        }
        bounds = {
            "temp": ">= 0",
            "top_p": "in (0, 1]",
            "min_p": "in [0, 1]",
            "min_tokens_to_keep": "an integer >= 1",
            "top_k": "an integer >= 0 (0: off)",
            "xtc_probability": "in [0, 1]",
            "xtc_threshold": "in [0, 0.5]",
        }
        for name, fine in ranges.items():
            if not fine:
                raise ValueError(f"{name} must be {bounds[name]}, got {getattr(self, name)!r}")

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


def sampling_probs(logits: mx.array, temp: float, top_p: float = 1.0, **truncations) -> mx.array:
    """Rows of ``logits`` -> the distribution we sample from (``Sampling.probs``);
    ``truncations``: ``Sampling``'s other fields."""
    return Sampling(temp, top_p, **truncations).probs(logits)
