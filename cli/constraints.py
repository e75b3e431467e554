"""main.py's constrained-decoding and thinking flags: --regex, --json-schema, --grammar,
--thinking-budget and --no-thinking. Checked and compiled before the model loads (a refused schema
costs no wait), then built by constrained/build.py, as the server builds a request's.

    constraints.add_arguments(parser)
    constraints.check(args)       # sets args.compiled_pattern: compile_pattern's, or None
    constraint, forced = constraints.build(args, tokenizer, vocab_size, prompt)
"""

import os
import re
import sys
from typing import Optional

from cli import CliError, check_text_argument, read_text_file

GRAMMAR_FILE = re.compile(r"\S+\.(gbnf|lark|ebnf|txt)")  # a name, not inline grammar text


def add_arguments(parser):
    parser.set_defaults(compiled_pattern=None)  # check() compiles the pattern given
    constrained = parser.add_argument_group("constrained decoding")
    constrained.add_argument(
        "--regex", default=None, help="The output must fully match this regex (re.ASCII)."
    )
    constrained.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE_OR_JSON",
        help="The output must be JSON valid under this JSON Schema (a file or inline JSON).",
    )
    constrained.add_argument(
        "--json-schema-engine",
        choices=["llguidance", "regex"],
        default=None,
        help="Compile --json-schema with llguidance (full JSON Schema) or the built-in regex "
        "compiler, and only it (default: llguidance if installed, the built-in compiler "
        "for a schema llguidance refuses).",
    )
    constrained.add_argument(
        "--grammar",
        default=None,
        metavar="FILE_OR_TEXT",
        help="The output must be in this grammar's language: Lark (llguidance's dialect) or "
        "GBNF (llama.cpp), a file or inline text; needs llguidance.",
    )
    constrained.add_argument(
        "--grammar-format",
        choices=["auto", "lark", "gbnf"],
        default="auto",
        help="The --grammar syntax (default: auto, GBNF when rules are written 'name ::= ...').",
    )
    thinking = parser.add_argument_group(
        "thinking models",
        "A model that thinks (<think> ... </think>) gets its constraint after the think block.",
    )
    thinking.add_argument(
        "--thinking-budget",
        type=int,
        default=None,
        metavar="N",
        help="At most N tokens inside the think block; then its closing text is forced.",
    )
    thinking.add_argument(
        "--no-thinking",
        action="store_true",
        help="Render the chat template with thinking off; a block it still opens is closed at "
        "once.",
    )


def check(args):
    """Refuse bad constraint and thinking flags in one line, and compile the pattern into
    ``args.compiled_pattern`` (RegexError, SchemaError, GrammarError), before the model loads."""
    from constrained.build import compile_pattern

    check_text_argument(args.regex, "--regex")
    # inline JSON, not a file name
    if args.json_schema is not None and not os.path.exists(args.json_schema):
        check_text_argument(args.json_schema, "--json-schema")
    for flag in ("json_schema", "grammar"):  # a folder would be read as inline text: say what it is
        if getattr(args, flag) is not None and os.path.isdir(getattr(args, flag)):
            raise CliError(
                f"--{flag.replace('_', '-')} {getattr(args, flag)} is a directory; give a file path"
            )
    if args.thinking_budget is not None and args.thinking_budget < 1:
        raise CliError("--thinking-budget must be >= 1 (--no-thinking turns thinking off)")
    if args.thinking_budget is not None and args.no_thinking:
        raise CliError("give --thinking-budget or --no-thinking, not both")
    if args.regex is not None and args.json_schema is not None:
        raise CliError("give --regex or --json-schema, not both")
    if args.grammar is not None and (args.regex is not None or args.json_schema is not None):
        raise CliError("give --grammar alone, not with --regex or --json-schema")
    pattern = pattern_of(args)
    if pattern is not None:
        args.compiled_pattern = compile_pattern(
            *pattern, schema_engine=args.json_schema_engine, grammar_format=args.grammar_format
        )


def pattern_of(args) -> Optional[tuple]:
    """``(kind, pattern)`` for ``compile_pattern``, read from a file where the flag names one."""
    if args.grammar is not None:
        # a missing file: "not found", not a parse error
        is_file = os.path.isfile(args.grammar) or GRAMMAR_FILE.fullmatch(args.grammar) is not None
        text = read_text_file(args.grammar, "grammar file") if is_file else args.grammar
        check_text_argument(text, "--grammar")
        return "grammar", text
    if args.json_schema is not None:
        from constrained import load_schema

        return "schema", load_schema(args.json_schema)  # SchemaError
    return None if args.regex is None else ("regex", args.regex)


def thinking_budget(args) -> Optional[int]:
    """The think block's budget: 0 with --no-thinking, as the template may still open the block."""
    return 0 if args.no_thinking else args.thinking_budget


def build(args, tokenizer, vocab_size: int, prompt: list, encoder_decoder: bool = False) -> tuple:
    """``(constraint, forced-text sources)`` for ``args`` (``check``ed), after the think block of
    a thinking model's ``prompt``; ``(None, [])`` where nothing constrains the output."""
    from constrained.build import ConstraintBuilder
    from constrained.thinking import thinking_of
    from loading.store import cache_dir

    if encoder_decoder and args.compiled_pattern is not None:
        needs = (
            "--regex needs a byte-level or sentencepiece Hugging Face tokenizer"
            if args.compiled_pattern[0] == "regex"
            else "--grammar and --json-schema need a Hugging Face tokenizer"
        )
        raise CliError(f"{needs}; T5 is not supported")
    builder = ConstraintBuilder(tokenizer, vocab_size, cache_dir=cache_dir() / "regex-index")
    built = None if args.compiled_pattern is None else builder.index(*args.compiled_pattern)
    thinking = thinking_of(tokenizer, prompt, thinking_budget(args))
    if thinking is None and (args.thinking_budget is not None or args.no_thinking):
        flag = "--no-thinking" if args.no_thinking else "--thinking-budget"
        print(f"note: {flag} changes nothing: the model has no think markers", file=sys.stderr)
    constraint, forced = builder.fresh(built, thinking)
    return constraint, [] if forced is None else [forced]
