"""Which features work on which mlx-lm architectures: the compatibility table, written by running
the checks.

    python -m benchmarks.compatibility [--out docs/compatibility.md] [--architectures llama
    gemma3_text ...]

For every tiny model of tests/architectures.py (or the ones named), runs the checks of
tests/architecture_checks.py, the same functions tests/test_architectures.py runs (the MTP check
repeats a case of tests/test_mtp.py, on its tiny checkpoints with MTP weights), and writes one row
per architecture, grouped by the kinds of cache its ``make_cache()`` gives. A cell is

- pass: the tokens equal mlx-lm's own greedy tokens (and drafts were accepted and rejected);
- FAIL: other tokens (the first difference), or a crash (the exception, and the file it came from);
- refused: the engine declined with an error of its own (its one line);
- ``-`` (MTP only): the architecture's checkpoints ship no MTP layers that mtp/model.py reads;
- trees: pass (trees) where lookup's draft trees are verified, pass (chains) where the model drafts
  chains under ``tree_nodes`` (decoder/tree_pass.py says why, in one log line).

A second table lists each model's caches, layer by layer, and the masks its forward pass asks them
for. main.py's start for each model takes the longest (benchmarks/results/figures.md); ``--no-main``
leaves that out.
"""

import argparse
import sys
import tempfile
import traceback
from pathlib import Path

import mlx.core as mx
import mlx_lm

from mtp.model import MTP_ARCHITECTURES
from tests import architecture_checks as checks
from tests.architectures import ARCHITECTURES, build, cache_family, describe_caches, save, tokenizer

ROOT = Path(__file__).resolve().parent.parent
# What each kind of cache holds, for the section headings.
KINDS = {
    "KVCache": "full attention",
    "RotatingKVCache": "sliding-window attention",
    "ChunkedKVCache": "attention in chunks",
    "ArraysCache": "recurrent state (SSM, linear attention, convolution)",
}
COLUMNS = [
    "plain",
    "prompt lookup",
    "regex",
    "batch",
    "batch + lookup",
    "4-bit",
    "8-bit",
    "trees",
    "MTP",
    "main.py",
]
NO_MTP = "-"  # the architecture's checkpoints ship no MTP layers that we read


def short(text: str, limit: int = 90) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def outcome(check) -> str:
    """The cell for ``check()``: pass, FAIL (why) or refused (the engine's one line)."""
    try:
        check()
        return "pass"
    except checks.MainError as error:
        return f"refused: {short(error.line)}" if error.refused else f"FAIL: {short(error.line)}"
    except AssertionError as error:
        return f"FAIL: {short(error)}"
    except Exception as error:  # noqa: BLE001 - one cell's failure must not stop the table
        where = Path(traceback.extract_tb(error.__traceback__)[-1].filename).resolve()
        installed = "site-packages" in where.parts
        if where.is_relative_to(ROOT) and not installed and isinstance(error, ValueError):
            return f"refused: {short(error)}"  # how this toolkit says it cannot do something
        return f"FAIL: {type(error).__name__} in {origin(where)}: {short(error, 70)}"


def tree_outcome(model) -> str:
    """The trees cell: pass (trees) or pass (chains), or the check's FAIL or refusal."""
    trees = []
    result = outcome(lambda: trees.append(checks.check_trees(model)))
    if result != "pass":
        return result
    return "pass (trees)" if trees[0] else "pass (chains)"


def origin(path: Path) -> str:
    """Where an exception came from, short: mlx_lm/models/gemma2.py, decoder.py."""
    if "site-packages" in path.parts:
        return "/".join(path.parts[path.parts.index("site-packages") + 1 :])
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def run_row(name: str, smollm2_tokenizer, with_main: bool) -> tuple:
    """``(family, caches, cells)`` for one architecture."""
    try:
        model, config = build(name)
        caches = describe_caches(model)
    except Exception as error:  # noqa: BLE001
        return (
            "could not build",
            None,
            [f"FAIL: {type(error).__name__}: {short(error)}"] * len(COLUMNS),
        )

    def main_check():
        with tempfile.TemporaryDirectory() as directory:
            checks.check_main(model, save(Path(directory) / name, model, config), smollm2_tokenizer)

    cells = [
        outcome(check)
        for check in (
            lambda: checks.check_plain(model),
            lambda: checks.check_prompt_lookup(model),
            lambda: checks.check_regex(model, smollm2_tokenizer),
            lambda: checks.check_batch(model),
            lambda: checks.check_batch(model, lookup=True),
            lambda: checks.check_quantized(model, config, bits=4),
            lambda: checks.check_quantized(model, config, bits=8),
        )
    ]
    cells.append(tree_outcome(model))
    model_type = config["model_type"]
    cells.append(
        outcome(lambda: checks.check_mtp(model_type)) if model_type in MTP_ARCHITECTURES else NO_MTP
    )
    cells.append(outcome(main_check) if with_main else "not run")
    return cache_family(model), caches, cells


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def masks_text(masks: list) -> str:
    """ "#1 KVCache; #0 RotatingKVCache(8), window 8": the caches asked for a mask (their index in
    the model's list), with the window the model passed."""
    seen = dict.fromkeys(
        f"#{index} {cache}" + (f", window {size}" if size else "") for index, cache, size in masks
    )
    return "; ".join(seen) or "none"


def caches_text(caches: list) -> str:
    """Runs of equal caches: "RotatingKVCache(8), KVCache x 2"."""
    runs = []
    for description in caches:
        if runs and runs[-1][0] == description:
            runs[-1][1] += 1
        else:
            runs.append([description, 1])
    return ", ".join(d if count == 1 else f"{d} x {count}" for d, count in runs)


# What the table's checks are, under its title.
CHECKS_TEXT = [
    "Each architecture is a tiny random model (tests/architectures.py: its mlx-lm `ModelArgs` "
    "at toy sizes, SmolLM2's tokenizer, sliding windows and attention chunks of 8 tokens, "
    "hybrid stacks with both attention and recurrent layers). Each check "
    "(tests/architecture_checks.py) decodes past the windows and compares with mlx-lm's own "
    "greedy tokens: plain decoding; prompt lookup copying from a near-copy of the output "
    "(drafts accepted and rejected); a regex with forced text and lookup against the "
    "constraint alone; a batch of four rows of different lengths, each against its prompt "
    "alone, without and with lookup; 4- and 8-bit (mlx-lm's quantization, group 64), plain and "
    "lookup; lookup drafting trees of 4 nodes from two near-copies of the output, one row "
    "and a batch of three (docs/draft_trees.md): **pass (trees)** where trees were verified, "
    "**pass (chains)** where the model drafts chains instead; "
    "`main.py --model DIR --json --prompt-lookup` on the saved model.",
    "",
    "**MTP**: for the architectures whose MTP layers we read "
    f"({', '.join(MTP_ARCHITECTURES)}), greedy decoding with `MTPSource` drafts gives mlx-lm's "
    "greedy tokens, with drafts accepted and rejected, on a tiny checkpoint with MTP weights "
    "in the Hugging Face layout (tests/mtp_fixtures.py, whose MTP layer is right often, not "
    f"always); **{NO_MTP}**: the architecture ships no MTP layers that we read.",
    "",
    "**pass**: mlx-lm's tokens. **FAIL**: other tokens (the first difference) or a crash "
    "(where it came from). **refused**: the engine declined, in its own words.",
    "",
]


def write_table(rows: dict, command: str) -> str:
    families = {}
    for name, (family, caches, cells) in rows.items():
        families.setdefault(family, []).append((name, caches, cells))
    passed = sum(
        all(c in ("pass", NO_MTP, "not run") or c.startswith("pass (") for c in cells)
        for _, _, cells in rows.values()
    )
    lines = [
        "# Compatibility: mlx-lm architectures x features",
        "",
        f"Written by `{command}` (do not edit by hand): mlx-lm {mlx_lm.__version__}, mlx "
        f"{mx.__version__}, {'Metal GPU' if mx.metal.is_available() else 'CPU'}.",
        "",
        *CHECKS_TEXT,
        f"{passed} of {len(rows)} architectures pass everything.",
        "",
    ]
    header = "| architecture | " + " | ".join(COLUMNS) + " |"
    for family, members in families.items():
        meaning = "; ".join(
            KINDS[kind] for kind in family.split(",")[0].split(" + ") if kind in KINDS
        )
        lines += [
            f"## {family}",
            "",
            f"{meaning[:1].upper()}{meaning[1:]}.",
            "",
            header,
            "|" + " --- |" * (len(COLUMNS) + 1),
        ]
        lines += [
            f"| {name} | " + " | ".join(cell(c) for c in cells) + " |" for name, _, cells in members
        ]
        lines.append("")
    lines += [
        "## Caches",
        "",
        "What each model's `make_cache()` gives, in layer order (fewer caches than layers: some "
        "layers share another's cache or keep none), and which of them its forward pass asks for a "
        "mask (`make_mask`; #index in that list), with the window it passes. No model keeps tokens "
        "at the front of a window (`keep`): that would show as `RotatingKVCache(size, keep=n)`.",
        "",
        "| architecture | caches | masks asked of |",
        "| --- | --- | --- |",
    ]
    for name, (_, caches, _) in rows.items():
        if caches is not None:
            layers = (
                "" if len(caches["caches"]) == caches["layers"] else f" ({caches['layers']} layers)"
            )
            lines.append(
                f"| {name} | {caches_text(caches['caches'])}{layers} | "
                f"{masks_text(caches['masks'])} |"
            )
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="Write the markdown here (default: print it).")
    parser.add_argument(
        "--architectures",
        nargs="+",
        default=list(ARCHITECTURES),
        metavar="NAME",
        help="Keys of tests/architectures.ARCHITECTURES or mlx-lm model types (default: all).",
    )
    parser.add_argument(
        "--no-main", action="store_true", help="Leave out main.py (a process per model)."
    )
    args = parser.parse_args()
    smollm2_tokenizer = tokenizer()
    rows = {}
    for name in args.architectures:
        rows[name] = run_row(name, smollm2_tokenizer, not args.no_main)
        print(
            f"{name}: " + ", ".join(f"{c}: {o}" for c, o in zip(COLUMNS, rows[name][2])),
            file=sys.stderr,
            flush=True,
        )
    command = " ".join(["python -m benchmarks.compatibility"] + sys.argv[1:])
    text = write_table(rows, command)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
