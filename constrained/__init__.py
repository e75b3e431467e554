"""Regex-constrained decoding: regex -> byte DFA -> token index -> logits masks and free drafts."""

from constrained.constraint import ForcedTextSource, RegexConstraint
from constrained.regex_dfa import RegexError, compile_regex

__all__ = ["ForcedTextSource", "RegexConstraint", "RegexError", "compile_regex"]
