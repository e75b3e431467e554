"""Continuous batching on decoder.py's per-row step: many sequences, each with its own draft sources,
constraint and sampling, verified together in one ``[B, W]`` pass per step.

- ``generator.py``: ``BatchGenerator`` (rows join and leave; ``insert``/``next``/``remove``) and
  ``batch_generate``.
- ``cache.py``: ``probe``, what a batch must know of a model.
- ``policy.py``: how many draft tokens the pass verifies (``choose_width``), from measured pass costs.

A draft model drafts for all its rows in one call: ``speculative.DraftModel`` (one class for one row
and many; ``BatchDraftModel`` is its name here, kept for callers that import it from batch).
"""

from speculative.draft_model import DraftModel as BatchDraftModel
from batch.generator import BatchGenerator, BatchResult, BatchStats, RowResponse, TokenLogprobs, batch_generate

__all__ = ["BatchDraftModel", "BatchGenerator", "BatchResult", "BatchStats", "RowResponse", "TokenLogprobs",
           "batch_generate"]
