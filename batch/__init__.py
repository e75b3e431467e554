"""Continuous batching on decoder/step.py's step: many sequences, each with its own draft sources,
constraint and sampling, verified together in one ``[B, W]`` pass per step.

- ``generator.py``: ``BatchGenerator`` (rows join and leave; ``insert``/``next``/``remove``).
- ``row.py``: ``BatchRow``, one sequence in the batch, made from ``insert``'s options
  (``new_rows``), and ``RowResponse``, what a step tells of it.
- ``logprobs.py``: ``TokenLogprobs``, the target's logprobs of each emitted token.
- ``batch_generate.py``: ``batch_generate`` and ``BatchResult``: prompts in, texts out.
- ``model_probe.py``: ``probe``, what a batch must know of a model; ``stats.py``: ``BatchStats``,
  what the generator counts.
- ``policy.py``: how many draft tokens the pass verifies (``choose_width``), from measured pass
  costs, and which waiting prompts prefill together (``prefill_group``).

A model that drafts (``decoder.model_drafter.SharedDrafter``: a draft model, a head, MTP layers)
drafts for all its rows in one call when the generator is handed it
(``BatchGenerator(drafters=[...])``).
"""

from batch.batch_generate import BatchResult, batch_generate
from batch.generator import BatchGenerator
from batch.logprobs import TokenLogprobs
from batch.row import RowResponse
from batch.stats import BatchStats

__all__ = [
    "BatchGenerator",
    "BatchResult",
    "BatchStats",
    "RowResponse",
    "TokenLogprobs",
    "batch_generate",
]
