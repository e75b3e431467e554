"""The draft-source and distributed flags main.py and the server share, and their checks: a flag
read here means the same in ``python main.py`` and ``python -m server``. Nothing here imports MLX
(building the sources from the flags is ``cli/sources.py``'s job; ``check_sampling`` builds the
flags' ``decoder.Sampling``, importing it then).

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
        "shipped for the embedded model.",
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
    parser.add_argument(
        "--tree-nodes",
        default="auto",
        metavar="N|auto",
        help="Draft trees of at most N candidate tokens per step, verified in one pass (prompt "
        f"and history lookup; 1 to {MAX_TREE_NODES}); 0: one chain per step, as before; auto "
        "(default): as many nodes as the measured pass cost and acceptance say pay, and chains "
        "instead while steps with trees emit fewer tokens per second here than steps with chains.",
    )
    add_quantization_arguments(parser)
    add_distributed_arguments(parser)


def add_quantization_arguments(parser):
    """--kv-bits and --kv-group-size."""
    quantization = parser.add_argument_group(
        "KV cache quantization",
        "Attention layers keep their keys and values quantized; recurrent states stay as they "
        "are. Drafts are verified against the quantized cache: the output is plain decoding's "
        "with the same --kv-bits.",
    )
    quantization.add_argument(
        "--kv-bits",
        type=int,
        default=None,
        help="Bits per key and value: 4 or 8 (default: not quantized).",
    )
    quantization.add_argument(
        "--kv-group-size",
        type=int,
        default=64,
        help="Values per scale and bias: 32, 64 or 128 (default: 64).",
    )
    quantization.add_argument(
        "--quantized-kv-start",
        type=int,
        default=None,
        help="Tokens held before the cache is quantized (main.py's default: 5000, mlx-lm's). The "
        "server quantizes from the first token (0): a batch's rows would reach any other start at "
        "different steps, and decode unlike they do alone.",
    )


def check_quantization(args):
    """The widths and group sizes mlx's quantized attention takes (``mx.quantize``'s)."""
    if args.kv_bits is not None and args.kv_bits not in (4, 8):
        raise CliError(f"--kv-bits must be 4 or 8, not {args.kv_bits}")
    if args.kv_group_size not in (32, 64, 128):
        raise CliError(f"--kv-group-size must be 32, 64 or 128, not {args.kv_group_size}")
    if args.quantized_kv_start is not None and args.quantized_kv_start < 0:
        raise CliError("--quantized-kv-start must be >= 0")


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


def add_prompt_store_arguments(parser):
    """--prompt-cache-dir and --prompt-cache-disk-bytes (main.py and the server)."""
    group = parser.add_argument_group(
        "prompt cache on disk (docs/prompt_store.md)",
        "Without --prompt-cache-dir nothing is written to disk.",
    )
    group.add_argument(
        "--prompt-cache-dir",
        default=None,
        help="Keep prompts' caches in blocks in this folder, shared by models and processes; a "
        "later prompt that starts the same restores them instead of prefilling.",
    )
    group.add_argument(
        "--prompt-cache-disk-bytes",
        type=int,
        default=10 * 2**30,
        help="The folder's size cap, least recently used blocks out, over every model in it "
        "(default: 10 GiB; 0: read only).",
    )


def open_prompt_store(args, model, session=None, target: bool = True):
    """The flags' ``PromptStore`` for ``model`` (sharded: this rank's shard, whose restores agree
    with the other ranks'), or None without --prompt-cache-dir; ``target``: the model the flags'
    --kv-bits quantize (a draft model's cache is not)."""
    if args.prompt_cache_dir is None:
        return None
    from prompt_store import PromptStore

    try:
        quantized = dict(
            kv_bits=args.kv_bits if target else None,
            kv_group_size=args.kv_group_size,
            quantized_kv_start=args.quantized_kv_start or 0,
        )
        if session is None:
            return PromptStore(
                args.prompt_cache_dir, model, args.prompt_cache_disk_bytes, **quantized
            )
        shard = f"rank {session.rank} of {session.size}, {session.mode}"
        return PromptStore(
            args.prompt_cache_dir,
            model,
            args.prompt_cache_disk_bytes,
            shard=shard,
            agree=session.fewest,
            **quantized,
        )
    except ValueError as error:
        raise CliError(f"--prompt-cache-dir: {error}") from None


def check(args):
    """Refuse bad draft-source, distributed and prompt store flags in one line, before the model
    loads."""
    if args.dist_timeout <= 0:
        raise CliError("--dist-timeout must be > 0")
    if args.prompt_cache_disk_bytes < 0:
        raise CliError("--prompt-cache-disk-bytes must be >= 0 (0: read only)")
    check_quantization(args)
    if args.num_draft is not None and not 1 <= args.num_draft <= 256:
        raise CliError("--num-draft must be between 1 and 256")
    args.tree_nodes = tree_nodes(args.tree_nodes)
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


# A tree pass's nodes must fit the rollback a sliding-window layer keeps (``decoder.layer_caches``).
MAX_TREE_NODES = 32


def tree_nodes(value):
    """``--tree-nodes``: "auto" or a count from 0 to ``MAX_TREE_NODES``."""
    if value == "auto":
        return value
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = -1
    if not 0 <= count <= MAX_TREE_NODES:
        raise CliError(f"--tree-nodes must be auto or a count from 0 to {MAX_TREE_NODES}")
    return count


def history_path(args) -> Path:
    return (
        Path(os.path.expanduser(args.lookup_history))
        if args.lookup_history
        else default_history_path()
    )


def default_history_path() -> Path:
    return cache_dir() / "history" / "store.npz"


def add_sampling_arguments(parser):
    """mlx-lm's sampling settings (``make_sampler``: one flag per field of ``decoder.Sampling``,
    its name in kebab case, unset by default: ``Sampling``'s default) and logits processors
    (``make_logits_processors``), with mlx-lm's names and defaults; docs/sampling.md says what
    each does."""
    group = parser.add_argument_group(
        "sampling controls (mlx-lm's; drafts are verified against the result, see docs/sampling.md)"
    )
    for flag, kind, meaning in (
        ("--temp", float, "Sampling temperature; 0 is greedy (default: 0)."),
        ("--top-p", float, "Nucleus sampling mass in (0, 1] (default: 1, off)."),
        ("--top-k", int, "Keep the k most likely tokens (default: 0, off)."),
        ("--min-p", float, "Drop tokens below min-p times the top token's probability (0: off)."),
        ("--min-tokens-to-keep", int, "Tokens --min-p always keeps (default: 1)."),
        (
            "--xtc-probability",
            float,
            "How often XTC removes the likeliest tokens above --xtc-threshold (0: off).",
        ),
        ("--xtc-threshold", float, "XTC's threshold in [0, 0.5] (default: 0.1)."),
    ):
        group.add_argument(flag, type=kind, default=None, help=meaning)
    for name, meaning in (
        ("repetition", "Divide (or multiply, if negative) the logits of recent tokens by this"),
        ("presence", "Subtract this from the logits of tokens seen recently"),
        ("frequency", "Subtract this times its count from the logit of each recent token"),
    ):
        group.add_argument(f"--{name}-penalty", type=float, default=None, help=f"{meaning}.")
        group.add_argument(
            f"--{name}-context-size",
            type=int,
            default=20,
            help=f"Recent tokens the {name} penalty reads; 0: all (default: 20).",
        )
    group.add_argument(
        "--logit-bias",
        default=None,
        metavar="JSON",
        help="Add to token logits, a JSON object of token id to bias: '{\"42\": -100}'.",
    )


def check_sampling(args):
    """Refuse bad sampling controls in one line: ``args.sampling`` becomes the flags'
    ``decoder.Sampling`` (checked as it is built) and ``args.logit_bias`` a dict of int to float."""
    from dataclasses import fields

    from decoder.sampling import Sampling, SamplingError

    names = {field.name for field in fields(Sampling)}
    given = {
        name: value for name, value in vars(args).items() if name in names and value is not None
    }
    try:
        args.sampling = Sampling(**given)  # an unset flag: Sampling's default
    except SamplingError as error:  # each setting's flag is its name in kebab case
        raise CliError(f"--{error.setting.replace('_', '-')} must be {error.bound}") from None
    bounds = [("repetition-penalty", (args.repetition_penalty or 0) >= 0, ">= 0")] + [
        (f"{name}-context-size", getattr(args, f"{name}_context_size") >= 0, ">= 0")
        for name in ("repetition", "presence", "frequency")
    ]
    for flag, fine, bound in bounds:
        if not fine:
            raise CliError(f"--{flag} must be {bound}")
    if args.logit_bias is not None:
        args.logit_bias = parse_logit_bias(args.logit_bias)


def parse_logit_bias(text: str) -> dict:
    """``--logit-bias``'s JSON object -> {token id: bias}, or a CliError saying what is wrong."""
    import json
    import math

    problem = "--logit-bias must be a JSON object of token ids to numbers, as '{\"42\": -100}'"
    try:
        value = json.loads(text)
    except ValueError:
        raise CliError(f"{problem}: it is not JSON") from None
    if not isinstance(value, dict):
        raise CliError(problem)
    bias = {}
    for key, number in value.items():
        if not key.strip().isdigit():
            raise CliError(f"{problem}: {key!r} is not a token id")
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise CliError(f"{problem}: the bias of {key} is not a number")
        if not math.isfinite(number):
            raise CliError(f"{problem}: the bias of {key} is not finite")
        bias[int(key)] = float(number)
    return bias


def processor_options(args) -> dict:
    """``make_logits_processors``' arguments from the flags."""
    processors = dict(logit_bias=args.logit_bias)
    for name in ("repetition", "presence", "frequency"):
        processors[f"{name}_penalty"] = getattr(args, f"{name}_penalty")
        processors[f"{name}_context_size"] = getattr(args, f"{name}_context_size")
    return processors
