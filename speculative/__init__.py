"""Speculative decoding with a draft model (Llama family or T5) or a trained draft head."""

import fast_blas

# `python -m speculative.train_head` imports this package first: load a fast BLAS before
# anything imports mlx.core (a no-op when already loaded, and on macOS).
fast_blas.load()

from speculative.draft_model import DraftModelSource, VocabularyMismatch  # noqa: E402

__all__ = ["DraftModelSource", "VocabularyMismatch"]
