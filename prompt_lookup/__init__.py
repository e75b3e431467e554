"""Prompt lookup decoding: draft by copying n-grams from the context (and, opt-in, from earlier
outputs)."""

from prompt_lookup.history import HistoryLookupSource, append_history, load_history
from prompt_lookup.ngram import PromptLookupSource, find_draft

__all__ = [
    "HistoryLookupSource",
    "PromptLookupSource",
    "append_history",
    "find_draft",
    "load_history",
]
