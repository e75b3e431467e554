"""Speculative decoding with a draft head: ours, trained on the target's hidden states
(head_training/), or a published EAGLE-1/2 or EAGLE-3 head; ``load_head`` reads both."""

from decoder.hidden_states import HeadMismatch
from draft_head.loading import load_head
from draft_head.source import DraftHeadSource, HeadDrafter

__all__ = ["DraftHeadSource", "HeadDrafter", "HeadMismatch", "load_head"]
