"""The trainer's command line (``python -m head_training.train``, train.py): its flags with their
defaults and help, the checks that refuse a bad value before minutes of generation, and the
directory name a model's head gets. Nothing here imports MLX.
"""

from pathlib import Path

from cli import CliError, check_finite


def add_data_arguments(parser):
    """The target, where things go, and the answers generated to train on."""
    parser.add_argument(
        "--model", default=None, help="Target model (default: the embedded SmolLM2-135M-Instruct)."
    )
    parser.add_argument(
        "--out",
        default=None,
        help="Head directory to write (default: draft_head/heads/smollm2-135m for the embedded "
        "model, else draft_head/heads/<the model's name>).",
    )
    parser.add_argument(
        "--work-dir",
        default=None,
        help="Cache of the generated data (default: ~/.cache/mlx-decoding/draft-head-data, "
        "in a subdirectory named after --model when given).",
    )
    parser.add_argument(
        "--instructions",
        nargs="+",
        choices=["self", "templates"],
        default=["self", "templates"],
        help="Where instructions come from: written by the target itself, or topic templates; "
        "several are answered one after the other (default: self templates).",
    )
    parser.add_argument(
        "--num-instructions",
        type=int,
        default=1000,
        help="Instructions per source (default: 1000).",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=128, help="Longest answer (default: 128)."
    )
    parser.add_argument(
        "--batch-size", type=int, default=48, help="Answers generated at once (default: 48)."
    )
    parser.add_argument(
        "--generate-minutes",
        type=float,
        default=45.0,
        help="Start no new batch after this long (instructions included) and train on what is "
        "done (default: 45; ~20 minutes are enough on 2 idle cores).",
    )
    parser.add_argument(
        "--sub-vocab", type=int, default=8192, help="Sub-vocabulary size (default: 8192)."
    )


def add_training_arguments(parser):
    """How the head is trained."""
    parser.add_argument(
        "--epochs", type=int, default=10, help="Passes over the data at most (default: 10)."
    )
    parser.add_argument(
        "--minutes", type=float, default=30.0, help="Stop training after this long (default: 30)."
    )
    parser.add_argument(
        "--unroll", type=int, default=3, help="Training-time unrolled draft steps (default: 3)."
    )
    parser.add_argument(
        "--depth1-fraction",
        type=float,
        default=0.5,
        help="Share of training spent on draft depth 1 alone before unrolling (default: 0.5).",
    )
    parser.add_argument(
        "--noise",
        type=float,
        default=0.05,
        help="Gaussian noise on input features (default: 0.05).",
    )
    parser.add_argument(
        "--lr", type=float, default=1e-3, help="Peak learning rate (default: 1e-3)."
    )
    parser.add_argument(
        "--token-weight",
        type=float,
        default=0.5,
        help="Weight of the token loss against the feature regression (default: 0.5).",
    )
    parser.add_argument(
        "--init",
        default=None,
        help="Continue training this head directory (default: a fresh head).",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="Seed for the instructions and training (default: 0)."
    )


def model_name(model) -> str:
    """``smollm2-135m`` for the embedded model, else the last part of its path or repo id."""
    return "smollm2-135m" if model is None else Path(model.rstrip("/")).name.lower()


def check_arguments(args):
    """Refuse values that would fail only after minutes of generation (one line each)."""
    check_finite(args)
    for name in ("num_instructions", "max_tokens", "batch_size", "sub_vocab", "epochs", "unroll"):
        if getattr(args, name) < 1:
            raise CliError(
                f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}"
            )
    if args.generate_minutes < 0 or args.minutes <= 0 or not 0 <= args.depth1_fraction <= 1:
        raise CliError(
            "--generate-minutes must be >= 0, --minutes > 0 and --depth1-fraction within 0 to 1"
        )
