"""Prompt lookup decoding: draft by copying n-grams from the context."""

from prompt_lookup.ngram import PromptLookupSource, find_draft

__all__ = ["PromptLookupSource", "find_draft"]
