"""The draft-source and distributed flags main.py and the server share, and their checks: a flag
read here means the same in ``python main.py`` and ``python -m server``. Nothing here imports MLX
(building the sources from the flags is ``cli/sources.py``'s job).

    flags.add_arguments(parser)   # --prompt-lookup, --draft-model, ..., --shard, --dist-timeout
    flags.check(args)             # before the model loads
"""

import os
from pathlib import Path

from cli import CliError
from loading.store import cache_dir


def add_arguments(parser, history: bool = True):
    """The draft-source and distributed flags. ``history=False`` leaves out --lookup-history (the
    server keeps no store); ``args.lookup_history`` is then None."""
    lookup = parser.add_argument_group("prompt lookup")
    lookup.add_argument(
        "--prompt-lookup", action="store_true", help="Draft by copying n-grams from the context."
    )
    if history:
        lookup.add_argument(
            "--lookup-history",
            nargs="?",
            const="",
            default=None,
            metavar="PATH",
            help="Prompt lookup that also copies from earlier outputs kept in a store file, and "
            "adds this output to it (opt-in: it writes generated text to disk); bare: "
            "~/.cache/mlx-decoding/history/store.npz.",
        )
    else:
        parser.set_defaults(lookup_history=None)
    lookup.add_argument(
        "--ngram-max", type=int, default=3, help="Longest suffix n-gram to match (default: 3)."
    )
    lookup.add_argument(
        "--ngram-min", type=int, default=1, help="Shortest suffix n-gram to match (default: 1)."
    )
    speculative = parser.add_argument_group("speculative decoding")
    speculative.add_argument(
        "--draft-model", default=None, help="Draft model directory or repo (same vocabulary)."
    )
    speculative.add_argument(
        "--mtp",
        action="store_true",
        help="Draft with the model's own multi-token-prediction layers (DeepSeek-V3, GLM-4.5 "
        "and Qwen3-Next checkpoints that ship them; convert.py keeps them).",
    )
    head = parser.add_argument_group("draft head")
    head.add_argument(
        "--draft-head",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="Draft with a trained head (a directory or a Hugging Face repo id); bare: the one "
        "shipped for the embedded model. The server then turns its prompt cache off (the "
        "head reads the whole prompt's hidden states).",
    )
    parser.add_argument(
        "--num-draft",
        type=int,
        default=None,
        help="Tokens to draft per step (default: each source's measured best).",
    )
    parser.add_argument(
        "--no-adaptive", action="store_true", help="Keep the draft length fixed at --num-draft."
    )
    add_distributed_arguments(parser)


def add_distributed_arguments(parser):
    """--shard and --dist-timeout, read under mlx.launch."""
    distributed = parser.add_argument_group(
        "distributed (under mlx.launch; see distributed/README.md)",
        "Ranks on one host split its cores between their BLAS threads unless "
        "OPENBLAS_NUM_THREADS is set.",
    )
    distributed.add_argument(
        "--shard",
        choices=["auto", "tensor", "pipeline"],
        default="auto",
        help="How to split the target over the ranks (default: tensor where the heads divide).",
    )
    distributed.add_argument(
        "--dist-timeout",
        type=float,
        default=120.0,
        help="Seconds to wait for peers to connect or answer before giving up (default: 120).",
    )


def check(args):
    """Refuse bad draft-source and distributed flags in one line, before the model loads."""
    if args.dist_timeout <= 0:
        raise CliError("--dist-timeout must be > 0")
    if args.num_draft is not None and not 1 <= args.num_draft <= 256:
        raise CliError("--num-draft must be between 1 and 256")
    if args.mtp and (args.draft_model is not None or args.draft_head is not None):
        raise CliError(
            "give --mtp alone, not with --draft-model or --draft-head (one model drafts)"
        )
    if not 1 <= args.ngram_min <= args.ngram_max <= 256:
        raise CliError(
            "--ngram-min and --ngram-max must satisfy 1 <= ngram-min <= ngram-max <= 256"
        )
    if args.lookup_history is not None:
        path = history_path(args)
        if path.is_dir():
            raise CliError(
                f"--lookup-history {path} is a directory; "
                "give a file path (a new name starts a new store)"
            )
        # the store's folder is made if missing
        parent = next((p for p in path.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise CliError(f"--lookup-history {path}: {parent} is not a directory")


def history_path(args) -> Path:
    return (
        Path(os.path.expanduser(args.lookup_history))
        if args.lookup_history
        else default_history_path()
    )


def default_history_path() -> Path:
    return cache_dir() / "history" / "store.npz"
