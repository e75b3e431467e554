"""Draft sources and constraints from command-line flags: the one builder main.py and the server share.

    sources.add_arguments(parser)                 # --prompt-lookup, --draft-model, --draft-head, ...
    sources.check(args)                           # before the model loads
    model, drafts = sources.draft_sources(args, model, tokenizer)   # run the loop on the returned model
    kind, compiled = sources.compile_schema(schema)  # llguidance, else the built-in regex compiler

A flag read here means the same in ``python main.py`` and ``python -m server``: both parse it
with the same definition and build its source with the same code.
"""

import os
import sys
from pathlib import Path

from cli import CliError


def add_arguments(parser, history: bool = True):
    """The draft-source flags. ``history=False`` leaves out --lookup-history (the server keeps
    no store); ``args.lookup_history`` is then None."""
    lookup = parser.add_argument_group("prompt lookup")
    lookup.add_argument("--prompt-lookup", action="store_true", help="Draft by copying n-grams from the context.")
    if history:
        lookup.add_argument("--lookup-history", nargs="?", const="", default=None, metavar="PATH",
                            help="Prompt lookup that also copies from earlier outputs kept in a store file, and "
                                 "adds this output to it (opt-in: it writes generated text to disk); bare: "
                                 "~/.cache/mlx-decoding/history/store.npz.")
    else:
        parser.set_defaults(lookup_history=None)
    lookup.add_argument("--ngram-max", type=int, default=3, help="Longest suffix n-gram to match (default: 3).")
    lookup.add_argument("--ngram-min", type=int, default=1, help="Shortest suffix n-gram to match (default: 1).")
    speculative = parser.add_argument_group("speculative decoding")
    speculative.add_argument("--draft-model", default=None, help="Draft model directory or repo (same vocabulary).")
    head = parser.add_argument_group("draft head")
    head.add_argument("--draft-head", nargs="?", const="", default=None, metavar="DIR",
                      help="Draft with a trained head (a directory or a Hugging Face repo id); bare: the one "
                           "shipped for the embedded model. The server then turns its prompt cache off (the "
                           "head reads the whole prompt's hidden states).")
    parser.add_argument("--num-draft", type=int, default=None,
                        help="Tokens to draft per step (default: each source's measured best).")
    parser.add_argument("--no-adaptive", action="store_true", help="Keep the draft length fixed at --num-draft.")


def check(args):
    """Refuse bad draft-source flags in one line, before the model loads."""
    if args.num_draft is not None and not 1 <= args.num_draft <= 256:
        raise CliError("--num-draft must be between 1 and 256")
    if not 1 <= args.ngram_min <= args.ngram_max <= 256:
        raise CliError("--ngram-min and --ngram-max must satisfy 1 <= ngram-min <= ngram-max <= 256")
    if args.lookup_history is not None:
        path = history_path(args)
        if path.is_dir():
            raise CliError(f"--lookup-history {path} is a directory; give a file path (a new name starts a new store)")
        parent = next((p for p in path.parents if p.exists()), None)  # the store's folder is made if missing
        if parent is not None and not parent.is_dir():
            raise CliError(f"--lookup-history {path}: {parent} is not a directory")


def history_path(args) -> Path:
    return Path(os.path.expanduser(args.lookup_history)) if args.lookup_history else default_history_path()


def default_history_path() -> Path:
    from loading import cache_dir

    return cache_dir() / "history" / "store.npz"


def draft_sources(args, model, tokenizer, encoder_input=None):
    """``(model, sources)`` for the flags in ``args``: prompt (or history) lookup, a draft model,
    a draft head, in that order. Run the loop on the returned model (a ``HiddenStateTap`` when a
    head drafts).

    Args:
        encoder_input: a T5 target's prompt tokens (its decoder starts empty); lookup searches them.

    Model drafts sample as the target does: the loop hands each generation's ``temp``/``top_p``
    to the sources' ``reset``.
    """
    sources, head_dir = [], None
    if args.draft_head is not None:
        if encoder_input is not None:  # before any download
            raise CliError("--draft-head needs a decoder-only model; T5 is not supported")
        head_dir = draft_head_dir(args.draft_head)
    if args.prompt_lookup or args.lookup_history is not None:
        sources.append(lookup_source(args, encoder_input or [], head_dir))
    options = {} if args.num_draft is None else {"num_draft": args.num_draft}
    if args.draft_model is not None:
        from loading import load_model
        from speculative import DraftModelSource

        draft_model, draft_tokenizer, _ = load_model(args.draft_model)
        sources.append(DraftModelSource.create(draft_model, draft_tokenizer, model, tokenizer,
                                               encoder_input=encoder_input, adaptive=not args.no_adaptive,
                                               **options))
    if head_dir is not None:
        from speculative.head import HeadMismatch
        from speculative.head_source import DraftHeadSource

        try:
            # With prompt lookup before it, the loop lets the head draft on the steps it is
            # expected to pay more (decoder.choose_draft).
            model, source = DraftHeadSource.create(model, head_dir, adaptive=not args.no_adaptive, **options)
        except HeadMismatch as error:
            raise CliError(str(error)) from None
        sources.append(source)
    return model, sources


def lookup_source(args, encoder_input: list, head_dir=None):
    """Prompt lookup, over the history store too with --lookup-history (which includes prompt lookup).

    With --draft-head, the store starts with the seed that ships with the head (``history.npz``,
    answers to its training instructions), read-only; the run appends only to PATH."""
    from prompt_lookup import PromptLookupSource

    options = {"ngram_max": args.ngram_max, "ngram_min": args.ngram_min, "extra_context": encoder_input,
               "adaptive": not args.no_adaptive}
    if args.num_draft is not None:
        options["num_draft"] = args.num_draft
    if args.lookup_history is None:
        return PromptLookupSource(**options)
    import numpy as np

    from prompt_lookup.history import HistoryError, HistoryLookupSource, load_history

    seed = np.zeros(0, np.int32)
    if head_dir is not None:
        try:
            seed = load_history(Path(head_dir) / "history.npz")  # older than anything in PATH
        except HistoryError as error:
            raise CliError(f"--draft-head {error}") from None
    path = history_path(args)
    try:
        stored = load_history(path)
    except HistoryError as error:
        # Only a store this tool made in its own cache may be deleted; a path the user gave is theirs.
        advice = "delete it to start a new one" if path == default_history_path() else "give another path"
        raise CliError(f"--lookup-history {error}; {advice}") from None
    history = np.concatenate([seed, stored])
    return HistoryLookupSource(history, **options)


def draft_head_dir(draft_head: str) -> str:
    """``--draft-head`` as a local directory: bare (""), the head shipped for the embedded model;
    a Hugging Face repo id is downloaded."""
    from speculative.head import SHIPPED_HEAD

    head_dir = os.path.expanduser(draft_head) if draft_head else str(SHIPPED_HEAD)
    if os.path.exists(head_dir):
        return head_dir
    if head_dir.count("/") != 1 or head_dir.startswith((".", "/")):
        raise CliError(f"--draft-head {head_dir} is neither a directory nor a Hugging Face repo id")
    from huggingface_hub import snapshot_download

    try:  # most EAGLE heads are published as pytorch_model.bin (read without running code)
        return snapshot_download(head_dir, allow_patterns=["config.json", "model.safetensors",
                                                           "pytorch_model.bin", "history.npz"])
    except Exception as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CliError(f"cannot download the draft head {draft_head}: {reason}") from None


def regex_constraint(regex: str, tokenizer, vocab_size: int, cache_dir=None) -> tuple:
    """``(constraint, forced-text source)`` for output that fully matches ``regex``; the token
    index is kept in ``cache_dir`` (RegexError for a regex it cannot serve)."""
    from constrained import ForcedTextSource, RegexConstraint

    constraint = RegexConstraint.from_regex(regex, tokenizer, vocab_size=vocab_size, cache_dir=cache_dir)
    return constraint, ForcedTextSource(constraint, tokenizer)


def grammar_constraint(grammar: str, tokenizer, vocab_size: int, splits=None) -> tuple:
    """``(constraint, forced-text source)`` for output in the language of ``grammar``, llguidance's
    compiled form (``compile_grammar``, ``compile_json_schema``; GrammarError if refused).
    ``splits``: a ``TokenSplits`` to share with other requests' forced-text sources."""
    from constrained.grammar import GrammarConstraint, GrammarForcedSource

    constraint = GrammarConstraint.from_llguidance(grammar, tokenizer, vocab_size=vocab_size)
    return constraint, GrammarForcedSource(constraint, tokenizer, splits)


def compile_schema(schema, engine=None) -> tuple:
    """``("grammar", llguidance's grammar)`` or ``("regex", regex)`` for JSON text that validates
    against ``schema``: how main.py and the server choose a schema compiler.

    Args:
        engine: "llguidance" or "regex" to use that one alone; None: llguidance (it serves more
            schemas, benchmarks/results/grammar.md), and the built-in regex compiler where llguidance
            is not installed or refuses a schema the built-in one serves, said in one line on stderr.

    Raises GrammarError or SchemaError (a RegexError); with no ``engine``, a SchemaError quoting
    both refusals, only when both refuse.
    """
    from constrained import RegexError, SchemaError, compile_regex, schema_to_regex
    from constrained.grammar import GrammarError, compile_json_schema

    if engine is None:
        try:
            import llguidance  # noqa: F401
        except ImportError:
            sys.stderr.write("note: llguidance is not installed, so the built-in compiler compiles the schema "
                             "(pip install llguidance for full JSON Schema)\n")
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
        compile_regex(regex)  # its DFA within the limits too: refused here, not once the model has loaded
    except RegexError as error:
        if refusal is None:
            raise
        raise SchemaError(f"{refusal}; the built-in compiler refused it too: {error}") from None
    if refusal is not None:
        reason = str(refusal).removeprefix("llguidance refused the schema: ")
        sys.stderr.write(f"note: llguidance refused the schema ({reason}); using the built-in compiler\n")
    return "regex", regex


def row_sources(args, model, tokenizer):
    """For the batched engine (batch.py): a function that returns fresh draft sources for one row,
    from the same flags as ``draft_sources`` (rows never share a stateful source). A draft model
    is loaded once, as a ``BatchDraftModel`` that drafts for all its rows in one pass; the draft
    head reads one sequence's hidden states and has no batched form (use ``draft_sources``)."""
    drafter = None
    options = {} if args.num_draft is None else {"num_draft": args.num_draft, "max_draft": max(12, args.num_draft)}
    if args.draft_model is not None:
        from batch_draft import BatchDraftModel
        from loading import load_model
        from speculative.draft_model import check_same_vocabulary, output_size
        from t5 import is_encoder_decoder

        draft_model, draft_tokenizer, _ = load_model(args.draft_model)
        if is_encoder_decoder(draft_model):
            raise CliError("--draft-model: a T5 draft model needs a T5 target, which batching does not serve")
        target_size = output_size(model, tokenizer)
        check_same_vocabulary(draft_tokenizer, tokenizer, output_size(draft_model, draft_tokenizer), target_size)
        drafter = BatchDraftModel(draft_model, target_size, adaptive=not args.no_adaptive, **options)

    def make() -> list:
        row = [lookup_source(args, [])] if args.prompt_lookup else []
        return row + ([drafter.source()] if drafter is not None else [])

    return make
