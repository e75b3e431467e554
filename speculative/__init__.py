"""Speculative decoding with a draft model (Llama family, or T5 with t5/) or a draft head (trained
here, or a published EAGLE-1/2 or EAGLE-3 head: ``load_head`` reads both)."""

from speculative.draft_model import DraftModel, DraftModelSource, VocabularyMismatch
from speculative.head import HeadMismatch
from speculative.head_loading import load_head
from speculative.head_source import DraftHeadSource, HiddenStateTap

__all__ = ["DraftHeadSource", "DraftModel", "DraftModelSource", "HeadMismatch", "HiddenStateTap", "VocabularyMismatch", "load_head"]
