"""Constrained decoding: (JSON Schema ->) regex -> byte DFA -> token index -> logits masks and free
drafts; grammars and full JSON Schema through llguidance (grammar.py; the package is imported only
when used)."""

from constrained.constraint import ForcedTextSource, RegexConstraint, TokenSplits
from constrained.grammar import GrammarConstraint, GrammarError, GrammarForcedSource
from constrained.json_schema import SchemaError, load_schema, schema_to_regex
from constrained.regex_dfa import RegexError, compile_regex

__all__ = [
    "ForcedTextSource",
    "GrammarConstraint",
    "GrammarError",
    "GrammarForcedSource",
    "RegexConstraint",
    "RegexError",
    "SchemaError",
    "TokenSplits",
    "compile_regex",
    "load_schema",
    "schema_to_regex",
]
