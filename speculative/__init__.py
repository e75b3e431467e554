"""Speculative decoding with a draft model (Llama family or T5)."""

from speculative.draft_model import DraftModelSource, VocabularyMismatch

__all__ = ["DraftModelSource", "VocabularyMismatch"]
