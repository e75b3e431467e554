"""`make demo`: the toolkit on tasks the embedded SmolLM2-135M-Instruct does well.

    python -m demo

Each line runs a ``python main.py ...`` command (printed, so it can be copied)
with colours on, then decodes the same prompt again with no draft source (the
same constraint, if any) in the same process, and prints the speed-up and
whether the text is identical. The plain run comes second, so any warm-up cost
falls on the drafted run: the speed-ups shown are, if anything, low.
"""

import shlex
import sys

from loading import fast_blas

fast_blas.load()  # before main imports mlx.core

import main  # noqa: E402  the demo runs main.py's own parser and build_run
from decoder import generate  # noqa: E402

DEMOS = [
    (
        "Extractive question over a document: prompt lookup copies the answer (green)",
        ["--prompt-file", "demo/museum.txt", "--prompt-lookup", "--max-tokens", "160"],
    ),
    (
        "Fields from an email as JSON of a fixed shape: the text the regex forces is drafted for "
        "free (cyan)",
        [
            "--prompt-file",
            "demo/order.txt",
            "--max-tokens",
            "96",
            "--regex",
            r'\{"name": "[A-Z][a-z]+ [A-Z][a-z]+", "quantity": \d+, "title": "[A-Za-z ]+", "city": '
            r'"[A-Z][a-z]+", '
            r'"phone": "[0-9 ]+"\}',
        ],
    ),
    # The trained draft head (--draft-head) is left out: on a CPU it gains less on average
    # (benchmarks/results/draft_head.md) than one prompt's run-to-run noise.
]


def run_demo(title: str, argv: list):
    print(f"\n=== {title}\n$ python main.py {shlex.join(argv)} --color\n", flush=True)
    args = main.build_parser().parse_args(argv + ["--color", "always"])
    drafted = main.run(args)
    model, tokenizer, prompt, kwargs = main.build_run(args)
    kwargs["draft_sources"] = []
    plain = generate(model, tokenizer, prompt, **kwargs)
    speedup = drafted.generation_tps / max(plain.generation_tps, 1e-9)
    same = (
        "identical text"
        if drafted.tokens == plain.tokens
        else "DIFFERENT TEXT (a bug: please report it)"
    )
    passes = drafted.stats.target_forward_passes / max(drafted.generation_tokens, 1)
    print(
        f"vs plain decoding: {drafted.generation_tps:.1f} vs {plain.generation_tps:.1f} tok/s = "
        f"{speedup:.2f}x faster ({passes:.2f} target passes per token instead of 1), {same}",
        flush=True,
    )


def main_demo():
    for title, argv in DEMOS:
        try:
            run_demo(title, argv)
        except KeyboardInterrupt:
            sys.exit(130)


if __name__ == "__main__":
    main_demo()
