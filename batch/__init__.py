"""Continuous batching on decoder.py's per-row step: many sequences, each with its own draft sources,
constraint and sampling, verified together in one ``[B, W]`` pass per step.

- ``generator.py``: ``BatchGenerator`` (rows join and leave; ``insert``/``next``/``remove``) and
  ``batch_generate``.
- ``cache.py``: ``Prefill`` (prompts into a ``cache.Cache`` of many rows, chunk by chunk) and ``probe``.
- ``policy.py``: how many draft tokens the pass verifies (``choose_width``), from measured pass costs.
- ``draft_model.py``: ``BatchDraftModel``, a draft model drafting for all its rows in one call.
"""

from batch.draft_model import BatchDraftModel
from batch.generator import BatchGenerator, BatchResult, BatchStats, RowResponse, TokenLogprobs, batch_generate

__all__ = ["BatchDraftModel", "BatchGenerator", "BatchResult", "BatchStats", "RowResponse", "TokenLogprobs",
           "batch_generate"]
