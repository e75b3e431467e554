"""Draft sources from command-line flags (``cli/flags.py``): the one builder main.py and the server
share.

    model, make, drafters = build_sources(args, model, tokenizer)   # run the loop on that model
    sources = make()                                         # one row's own sources (a batch: per
    row)

A flag means the same in ``python main.py`` and ``python -m server``: both parse it with the same
definition and build its source with the same code.
"""

import os
from pathlib import Path

import huggingface_hub
import numpy as np

from cli import CliError
from cli.flags import default_history_path, history_path, open_prompt_store
from decoder.hidden_states import HeadMismatch
from draft_head import HeadDrafter
from draft_head.head import SHIPPED_HEAD
from draft_model import DraftModel
from loading.load import load_model, resolve_model_path
from mtp.model import MTPError, NoMTPWeights
from mtp.source import MTPDrafter
from prompt_lookup import PromptLookupSource
from t5 import T5Decoder, is_encoder_decoder


def build_sources(args, model, tokenizer, encoder_input=None, session=None) -> tuple:
    """``(model, make, drafters)`` for the flags in ``args``: run the loop on the returned model (a
    ``HiddenStateTap`` when a head or MTP layers draft), and ``make()`` gives one row its own fresh
    sources: prompt (or history) lookup, a draft model, a draft head or the model's MTP layers, in
    that order. A model that drafts (a draft model, a head, MTP layers) is loaded once, one of
    ``drafters`` (for ``BatchGenerator(drafters=...)``), and each row holds a source of it.

    Args:
        encoder_input: a T5 target's prompt tokens (its decoder starts empty); lookup searches them.
        session: ``distributed.start``'s, sharded (a draft model's prompt store agrees with the
            other ranks').

    Model drafts sample as the target does: the loop hands each generation's ``temp``/``top_p``
    to the sources' ``reset``.
    """
    head_dir = None
    if args.draft_head is not None:
        if encoder_input is not None:  # before any download
            raise CliError("--draft-head needs a decoder-only model; T5 is not supported")
        head_dir = draft_head_dir(args.draft_head)
    lookup = None
    if args.prompt_lookup or args.lookup_history is not None:
        lookup = lookup_maker(args, encoder_input or [], head_dir)
    options = {
        "adaptive": not args.no_adaptive,
        **({} if args.num_draft is None else {"num_draft": args.num_draft}),
    }
    drafters = []
    if args.draft_model is not None:
        draft_model, draft_tokenizer, _ = load_model(args.draft_model)
        if is_encoder_decoder(draft_model):
            if encoder_input is None:
                raise CliError(
                    "--draft-model: a T5 draft model needs a T5 target, "
                    "which batching does not serve"
                )
            draft_model = T5Decoder(draft_model, encoder_input)
        # its own cache in the prompt store too (not T5's, which starts from the encoder's input)
        store = (
            None
            if encoder_input is not None
            else open_prompt_store(args, draft_model, session, target=False)
        )
        drafters.append(
            DraftModel.create(
                draft_model, draft_tokenizer, model, tokenizer, prompt_store=store, **options
            )
        )
    if head_dir is not None:
        try:
            # With prompt lookup before it, the loop lets the head draft on the steps it is
            # expected to pay more (draft.choose_draft).
            model, drafter = HeadDrafter.create(model, head_dir, **options)
        except HeadMismatch as error:
            raise CliError(str(error)) from None
        drafters.append(drafter)
    if args.mtp:
        model, drafter = mtp_drafter(args, model, encoder_input, **options)
        drafters.append(drafter)

    def make() -> list:
        return ([lookup()] if lookup is not None else []) + [
            drafter.source() for drafter in drafters
        ]

    return model, make, drafters


def draft_sources(args, model, tokenizer, encoder_input=None, session=None) -> tuple:
    """``(model, sources)``: ``build_sources`` for one sequence (main.py)."""
    model, make, _ = build_sources(args, model, tokenizer, encoder_input, session)
    return model, make()


def mtp_drafter(args, model, encoder_input=None, **options):
    """``(tap, drafter)``: the target's own MTP layers, read from the directory it was loaded from.
    A model without them raises ``NoMTPWeights`` (main.py: exit 2); damaged ones a CliError."""
    if encoder_input is not None:
        raise CliError("--mtp needs a decoder-only model with MTP layers; T5 has none")
    try:
        return MTPDrafter.create(model, resolve_model_path(args.model), **options)
    except NoMTPWeights:
        raise
    except MTPError as error:
        raise CliError(str(error)) from None


def lookup_maker(args, encoder_input: list, head_dir=None):
    """A function returning a fresh prompt lookup source, over the history store too with
    --lookup-history (which includes prompt lookup); the store is read once.

    With --draft-head, the store starts with the seed that ships with the head (``history.npz``,
    answers to its training instructions), read-only; the run appends only to PATH."""
    options = {
        "ngram_max": args.ngram_max,
        "ngram_min": args.ngram_min,
        "extra_context": encoder_input,
        "adaptive": not args.no_adaptive,
    }
    if args.num_draft is not None:
        options["num_draft"] = args.num_draft
    if args.lookup_history is None:
        return lambda: PromptLookupSource(**options)
    # opt-in: plain lookup never imports the store's code
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
        # Only a store this tool made in its own cache may be deleted; a path the user gave is
        # theirs.
        advice = (
            "delete it to start a new one"
            if path == default_history_path()
            else "give another path"
        )
        raise CliError(f"--lookup-history {error}; {advice}") from None
    history = np.concatenate([seed, stored])
    return lambda: HistoryLookupSource(history, **options)


def draft_head_dir(draft_head: str) -> str:
    """``--draft-head`` as a local directory: bare (""), the head shipped for the embedded model;
    a Hugging Face repo id is downloaded."""
    head_dir = os.path.expanduser(draft_head) if draft_head else str(SHIPPED_HEAD)
    if os.path.exists(head_dir):
        return head_dir
    if head_dir.count("/") != 1 or head_dir.startswith((".", "/")):
        raise CliError(f"--draft-head {head_dir} is neither a directory nor a Hugging Face repo id")
    try:  # most EAGLE heads are published as pytorch_model.bin (read without running code)
        return huggingface_hub.snapshot_download(
            head_dir,
            allow_patterns=["config.json", "model.safetensors", "pytorch_model.bin", "history.npz"],
        )
    except Exception as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CliError(f"cannot download the draft head {draft_head}: {reason}") from None
