"""Speculative decoding with a draft model (Llama family, or T5 with t5/), a draft head (trained
here, or a published EAGLE-1/2 or EAGLE-3 head: ``load_head`` reads both) or a model's own MTP
layers."""

from decoder.draft import DraftRequest
from speculative.draft_model import DraftModel, DraftModelSource, VocabularyMismatch
from speculative.drafter import SharedDrafter, SharedSource
from speculative.head import HeadMismatch
from speculative.head_loading import load_head
from speculative.head_source import DraftHeadSource, HeadDrafter, HiddenStateTap
from speculative.mtp_source import MTPDrafter, MTPSource

__all__ = [
    "DraftHeadSource",
    "DraftModel",
    "DraftModelSource",
    "DraftRequest",
    "HeadDrafter",
    "HeadMismatch",
    "HiddenStateTap",
    "MTPDrafter",
    "MTPSource",
    "SharedDrafter",
    "SharedSource",
    "VocabularyMismatch",
    "load_head",
]
