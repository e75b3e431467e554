"""Prompt lookup decoding: draft by copying n-grams from the context."""

from prompt_lookup.ngram import POLICIES, PromptLookupSource, find_draft

__all__ = ["POLICIES", "PromptLookupSource", "find_draft"]
