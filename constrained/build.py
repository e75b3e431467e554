"""Constraints and their forced-text sources, built from a regex, a JSON Schema or a grammar: the
one way main.py and the server build them.

    constraint, forced = regex_constraint(regex, tokenizer, vocab_size)
    kind, compiled = compile_schema(schema)   # llguidance, else the built-in regex compiler
"""

import sys

from constrained.constraint import ForcedTextSource, RegexConstraint
from constrained.grammar import (
    GrammarConstraint,
    GrammarError,
    GrammarForcedSource,
    compile_json_schema,
)
from constrained.json_schema import SchemaError, schema_to_regex
from constrained.regex_dfa import RegexError, compile_regex


def regex_constraint(regex: str, tokenizer, vocab_size: int, cache_dir=None) -> tuple:
    """``(constraint, forced-text source)`` for output that fully matches ``regex``; the token
    index is kept in ``cache_dir`` (RegexError for a regex it cannot serve)."""
    constraint = RegexConstraint.from_regex(
        regex, tokenizer, vocab_size=vocab_size, cache_dir=cache_dir
    )
    return constraint, ForcedTextSource(constraint, tokenizer)


def grammar_constraint(grammar: str, tokenizer, vocab_size: int, splits=None) -> tuple:
    """``(constraint, forced-text source)`` for output in the language of ``grammar``, llguidance's
    compiled form (``compile_grammar``, ``compile_json_schema``; GrammarError if refused).
    ``splits``: a ``TokenSplits`` to share with other requests' forced-text sources."""
    constraint = GrammarConstraint.from_llguidance(grammar, tokenizer, vocab_size=vocab_size)
    return constraint, GrammarForcedSource(constraint, tokenizer, splits)


def compile_schema(schema, engine=None) -> tuple:
    """``("grammar", llguidance's grammar)`` or ``("regex", regex)`` for JSON text that validates
    against ``schema``: how main.py and the server choose a schema compiler.

    Args:
        engine: "llguidance" or "regex" to use that one alone; None: llguidance (it serves more
            schemas, benchmarks/results/grammar.md), and the built-in regex compiler where
            llguidance is not installed or refuses a schema the built-in one serves, said in one
            line on stderr.

    Raises GrammarError or SchemaError (a RegexError); with no ``engine``, a SchemaError quoting
    both refusals, only when both refuse.
    """
    if engine is None:
        try:
            import llguidance  # noqa: F401
        except ImportError:
            sys.stderr.write(
                "note: llguidance is not installed, so the built-in compiler compiles the schema "
                "(pip install llguidance for full JSON Schema)\n"
            )
            engine = "regex"
    refusal = None
    if engine != "regex":
        try:
            return "grammar", compile_json_schema(schema)
        except GrammarError as error:
            if engine == "llguidance":  # asked for by name: no fallback
                raise
            refusal = error
    try:
        regex = schema_to_regex(schema)
        # its DFA within the limits too: refused here, not once the model has loaded
        compile_regex(regex)
    except RegexError as error:
        if refusal is None:
            raise
        raise SchemaError(f"{refusal}; the built-in compiler refused it too: {error}") from None
    if refusal is not None:
        reason = str(refusal).removeprefix("llguidance refused the schema: ")
        sys.stderr.write(
            f"note: llguidance refused the schema ({reason}); using the built-in compiler\n"
        )
    return "regex", regex
