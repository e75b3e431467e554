"""Regex-constrained decoding: (JSON Schema ->) regex -> byte DFA -> token index -> logits masks and free drafts."""

from constrained.constraint import ForcedTextSource, RegexConstraint
from constrained.json_schema import SchemaError, load_schema, schema_to_regex
from constrained.regex_dfa import RegexError, compile_regex

__all__ = ["ForcedTextSource", "RegexConstraint", "RegexError", "SchemaError", "compile_regex", "load_schema",
           "schema_to_regex"]
