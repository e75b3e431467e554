"""Prompt lookup decoding: draft by copying n-grams from the context (and, opt-in, from earlier
outputs: ``prompt_lookup.history``, imported only by those who use it)."""

from prompt_lookup.ngram import PromptLookupSource, find_draft

__all__ = ["PromptLookupSource", "find_draft"]
