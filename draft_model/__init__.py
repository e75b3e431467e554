"""Speculative decoding with a draft model: a small model with the target's vocabulary (Llama
family, or T5 through t5/, imported only for a T5 pair)."""

from draft_model.draft_model import DraftModel, DraftModelSource, VocabularyMismatch

__all__ = ["DraftModel", "DraftModelSource", "VocabularyMismatch"]
