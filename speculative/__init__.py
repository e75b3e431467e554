"""Speculative decoding with a draft model (Llama family or T5) or a draft head (trained here, or
a published EAGLE-1/2 or EAGLE-3 head: ``load_head`` reads both).

The names below are imported on first use, so ``python -m speculative.train_head`` can load
a fast BLAS before anything imports ``mlx.core`` (see fast_blas.py).
"""

import importlib

_EXPORTS = {
    "DraftModelSource": "speculative.draft_model",
    "VocabularyMismatch": "speculative.draft_model",
    "DraftHeadSource": "speculative.head_source",
    "HiddenStateTap": "speculative.head_source",
    "HeadMismatch": "speculative.head",
    "load_head": "speculative.head",
    "T5Decoder": "speculative.t5",
    "load_t5": "speculative.t5",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'speculative' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
