"""Constraints from a regex, a JSON Schema or a grammar, put after a thinking model's think block:
the one way main.py and the server build them, in three stages.

    form, compiled = compile_pattern("schema", schema)   # no tokenizer: before the model loads
    builder = ConstraintBuilder(tokenizer, vocab_size)
    built = builder.index(form, compiled)                # the costly part: keep it per pattern
    constraint, forced = builder.fresh(built, thinking)  # every sequence its own

    constraint, forced = regex_constraint(regex, tokenizer, vocab_size)  # all at once, for one
"""

import json
import sys

from constrained.constraint import ForcedTextSource, RegexConstraint, TokenSplits
from constrained.grammar import (
    GrammarConstraint,
    GrammarError,
    GrammarForcedSource,
    compile_grammar,
    compile_json_schema,
)
from constrained.json_schema import SchemaError, schema_to_regex
from constrained.regex_dfa import RegexError, compile_regex


def compile_pattern(kind: str, pattern, schema_engine=None, grammar_format: str = "auto") -> tuple:
    """``("regex", regex)`` or ``("grammar", llguidance's grammar)`` for a "regex", a JSON "schema"
    (loaded, or as JSON text; ``schema_engine``: see ``compile_schema``) or a "grammar" (Lark or
    GBNF text; ``grammar_format``: see ``compile_grammar``). Checked without a tokenizer, so a
    refusal comes before a model loads: RegexError, SchemaError (a RegexError) or GrammarError."""
    if kind == "schema":
        schema = json.loads(pattern) if isinstance(pattern, str) else pattern
        return compile_schema(schema, schema_engine)
    if kind == "grammar":
        return "grammar", compile_grammar(pattern, grammar_format)
    compile_regex(pattern)
    return "regex", pattern


class ConstraintBuilder:
    """Constraints on one model's vocabulary, from ``compile_pattern``'s output. No MLX call, and
    safe from any thread: the server builds each request's constraint off its worker.

    Args:
        vocab_size: the model's (the masks' width); ``cache_dir``: where regex token indexes are
            kept.
    """

    def __init__(self, tokenizer, vocab_size: int, cache_dir=None):
        self.tokenizer, self.vocab_size, self.cache_dir = tokenizer, vocab_size, cache_dir
        # how the model writes forced text, learned by every sequence built here
        self.splits = TokenSplits(tokenizer)

    def index(self, form: str, compiled: str) -> tuple:
        """``("regex", token index)`` or ``("grammar", llguidance's grammar)``: the pattern over
        the vocabulary, the part worth keeping per pattern. A grammar the vocabulary cannot serve
        is refused here (GrammarError), not at the first step."""
        if form == "grammar":
            GrammarConstraint.from_llguidance(compiled, self.tokenizer, self.vocab_size)
            return form, compiled
        constraint = RegexConstraint.from_regex(
            compiled, self.tokenizer, self.vocab_size, self.cache_dir
        )
        return form, constraint.index

    def fresh(self, built=None, thinking=None) -> tuple:
        """A new ``(constraint, forced-text source)`` on ``built`` (``index``'s; None: any output),
        after the think block of ``thinking`` (``constrained.thinking.thinking_of``'s; None: the
        model does not think). ``(None, None)`` where nothing constrains the output."""
        constraint = forced = None
        if built is not None and built[0] == "regex":
            constraint = RegexConstraint(built[1], self.splits)
            forced = ForcedTextSource(constraint)
        elif built is not None:
            constraint = GrammarConstraint.from_llguidance(
                built[1], self.tokenizer, self.vocab_size, self.splits
            )
            forced = GrammarForcedSource(constraint)
        if thinking is None:
            return constraint, forced
        return thinking.around(constraint, forced, self.vocab_size)


def regex_constraint(regex: str, tokenizer, vocab_size: int, cache_dir=None) -> tuple:
    """``(constraint, forced-text source)`` for output that fully matches ``regex``, from a
    one-off ``ConstraintBuilder`` (RegexError for a regex it cannot serve)."""
    builder = ConstraintBuilder(tokenizer, vocab_size, cache_dir)
    return builder.fresh(builder.index("regex", regex))


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
