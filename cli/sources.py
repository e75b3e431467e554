"""Draft sources from command-line flags (``cli/flags.py``): the one builder main.py and the server share.

    model, drafts = draft_sources(args, model, tokenizer)   # run the loop on the returned model
    make = row_sources(args, model, tokenizer)               # fresh sources per batch row: make()

A flag means the same in ``python main.py`` and ``python -m server``: both parse it with the same
definition and build its source with the same code.
"""

import os
from pathlib import Path

import huggingface_hub
import numpy as np

from cli import CliError
from cli.flags import default_history_path, history_path
from loading.load import load_model, resolve_model_path
from prompt_lookup import PromptLookupSource
from prompt_lookup.history import HistoryError, HistoryLookupSource, load_history
from speculative import DraftModel, DraftModelSource
from speculative.head import SHIPPED_HEAD, HeadMismatch
from speculative.head_source import DraftHeadSource
from speculative.mtp import MTPError, NoMTPWeights
from speculative.mtp_source import MTPSource
from t5 import is_encoder_decoder


def draft_sources(args, model, tokenizer, encoder_input=None):
    """``(model, sources)`` for the flags in ``args``: prompt (or history) lookup, a draft model,
    a draft head or the model's MTP layers, in that order. Run the loop on the returned model (a
    ``HiddenStateTap`` when a head or MTP layers draft).

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
        draft_model, draft_tokenizer, _ = load_model(args.draft_model)
        sources.append(DraftModelSource.create(draft_model, draft_tokenizer, model, tokenizer,
                                               encoder_input=encoder_input, adaptive=not args.no_adaptive,
                                               **options))
    if head_dir is not None:
        try:
            # With prompt lookup before it, the loop lets the head draft on the steps it is
            # expected to pay more (draft.choose_draft).
            model, source = DraftHeadSource.create(model, head_dir, adaptive=not args.no_adaptive, **options)
        except HeadMismatch as error:
            raise CliError(str(error)) from None
        sources.append(source)
    if args.mtp:
        model, source = mtp_source(args, model, encoder_input, **options)
        sources.append(source)
    return model, sources


def mtp_source(args, model, encoder_input=None, **options):
    """``(tap, source)``: the target's own MTP layers, read from the directory it was loaded from.
    A model without them raises ``NoMTPWeights`` (main.py: exit 2); damaged ones a CliError."""
    if encoder_input is not None:
        raise CliError("--mtp needs a decoder-only model with MTP layers; T5 has none")
    try:
        return MTPSource.create(model, resolve_model_path(args.model), adaptive=not args.no_adaptive, **options)
    except NoMTPWeights:
        raise
    except MTPError as error:
        raise CliError(str(error)) from None


def lookup_source(args, encoder_input: list, head_dir=None):
    """Prompt lookup, over the history store too with --lookup-history (which includes prompt lookup).

    With --draft-head, the store starts with the seed that ships with the head (``history.npz``,
    answers to its training instructions), read-only; the run appends only to PATH."""
    options = {"ngram_max": args.ngram_max, "ngram_min": args.ngram_min, "extra_context": encoder_input,
               "adaptive": not args.no_adaptive}
    if args.num_draft is not None:
        options["num_draft"] = args.num_draft
    if args.lookup_history is None:
        return PromptLookupSource(**options)
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
    head_dir = os.path.expanduser(draft_head) if draft_head else str(SHIPPED_HEAD)
    if os.path.exists(head_dir):
        return head_dir
    if head_dir.count("/") != 1 or head_dir.startswith((".", "/")):
        raise CliError(f"--draft-head {head_dir} is neither a directory nor a Hugging Face repo id")
    try:  # most EAGLE heads are published as pytorch_model.bin (read without running code)
        return huggingface_hub.snapshot_download(head_dir, allow_patterns=[
            "config.json", "model.safetensors", "pytorch_model.bin", "history.npz"])
    except Exception as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CliError(f"cannot download the draft head {draft_head}: {reason}") from None


def row_sources(args, model, tokenizer):
    """For the batched engine (``batch/``): a function that returns fresh draft sources for one row,
    from the same flags as ``draft_sources`` (rows never share a stateful source). A draft model
    is loaded once, as a ``DraftModel`` that drafts for all its rows in one pass; the draft
    head reads one sequence's hidden states and has no batched form (use ``draft_sources``)."""
    drafter = None
    options = {} if args.num_draft is None else {"num_draft": args.num_draft}
    if args.draft_model is not None:
        draft_model, draft_tokenizer, _ = load_model(args.draft_model)
        if is_encoder_decoder(draft_model):
            raise CliError("--draft-model: a T5 draft model needs a T5 target, which batching does not serve")
        drafter = DraftModel.create(draft_model, draft_tokenizer, model, tokenizer, adaptive=not args.no_adaptive,
                                         **options)

    def make() -> list:
        row = [lookup_source(args, [])] if args.prompt_lookup else []
        return row + ([drafter.source()] if drafter is not None else [])

    return make
