"""Time and peak memory of hostile `--json-schema` and `--regex` inputs, each in a fresh process.

    python -m benchmarks.hostile_inputs                 # this checkout
    python -m benchmarks.hostile_inputs --root OTHER    # another checkout (e.g. `git archive` of
    main)

Each case runs what `main.py` runs before loading a model (load the schema, compile it to a regex,
compile the regex to a DFA) and reports the seconds and peak memory after the imports, with a time
limit and an address-space limit so that a case that runs away cannot take the machine down.
Results: benchmarks/results/reliability.md.
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What main.py's validate() does with --json-schema / --regex, printing what main.py would print,
# then one JSON line: seconds and peak RSS (getrusage) spent after the imports.
DRIVER = """
import json, resource, sys, time
from loading import fast_blas
fast_blas.load()  # first, as in main.py
from constrained import RegexError, compile_regex, load_schema, schema_to_regex
kind, argument = sys.argv[1:]
start, rss_before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    regex = schema_to_regex(load_schema(argument)) if kind == "schema" else argument
    outcome = f"compiled: {compile_regex(regex).num_states} DFA states"
except RegexError as error:
    sys.stderr.write(f"error: {error}\\n")
    outcome = "refused"
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": time.perf_counter() - start, "rss_mb": peak // 1024,
                  "added_mb": (peak - rss_before) // 1024, "outcome": outcome}))
"""


def properties(count: int) -> dict:
    """`count` optional string properties, about 120 bytes each in the file."""
    return {
        "type": "object",
        "properties": {
            f"property_{index:06d}": {
                "type": "string",
                "description": "an optional field of a wide record",
            }
            for index in range(count)
        },
    }


def nested(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def ref_fanout(width: int) -> dict:
    """A recursive node with `width` children: each $ref expansion multiplies the work by
    `width`."""
    children = {f"c{index}": {"$ref": "#/$defs/node"} for index in range(width)}
    return {"$defs": {"node": {"type": "object", "properties": children}}, "$ref": "#/$defs/node"}


CASES = {
    "baseline: regex a (imports only)": ("regex", "a"),
    "84,000 optional properties (10 MB)": ("schema", properties(84_000)),
    "10,000 optional properties": ("schema", properties(10_000)),
    "1,000 optional properties": ("schema", properties(1_000)),
    "250 optional properties": ("schema", properties(250)),
    "150 optional properties": ("schema", properties(150)),
    "enum of 1,000,000 values": ("schema", {"enum": list(range(1_000_000))}),
    "integer minimum 10^24": (
        "schema",
        {"type": "integer", "minimum": 10**24, "maximum": 2 * 10**24 + 7},
    ),
    "integer minimum 1e308": ("schema", {"type": "integer", "minimum": 1e308}),
    "number in [-1.7e308, 1.7e308]": (
        "schema",
        {"type": "number", "minimum": -1.7e308, "maximum": 1.7e308},
    ),
    "minimum 1e400": ("schema", '{"type": "number", "minimum": 1e400}'),
    "maximum NaN": ("schema", '{"type": "number", "maximum": NaN}'),
    "schema 150 levels deep": ("schema", nested(150)),
    "JSON nested 100,000 levels": ("schema", "[" * 100_000 + "]" * 100_000),
    "recursive $ref, 40 children per node": ("schema", ref_fanout(40)),
    "enum filtered by pattern (a*)*b": (
        "schema",
        {"type": "string", "pattern": "^(a*)*b$", "enum": ["a" * 40, "a" * 10 + "b"]},
    ),
    "regex with 250 nested groups": ("regex", "(" * 250 + "a" + ")" * 250),
    "regex (a nested 900 deep": ("regex", "(a" * 900 + ")" * 900),
    "regex a{1000000}": ("regex", "a{1000000}"),
}


def run_case(kind, value, root: Path, directory: Path, timeout: float, memory_gb: float) -> dict:
    if kind == "schema":
        argument = directory / "schema.json"
        argument.write_text(value if isinstance(value, str) else json.dumps(value))
    else:
        argument = value
    limit = int(memory_gb * 2**30)

    # an address-space cap: a runaway case fails with MemoryError, not the OOM killer
    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    command = [sys.executable, "-c", DRIVER, kind, str(argument)]
    try:
        result = subprocess.run(
            command,
            cwd=root,
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=limit_memory,
        )
    except subprocess.TimeoutExpired:
        return {"outcome": f"killed after {timeout:.0f} s"}
    if result.returncode != 0 or not result.stdout.strip():
        lines = result.stderr.splitlines()
        return {
            "outcome": f"exit {result.returncode}, {len(lines)} lines on stderr, "
            f"last: {lines[-1][:120] if lines else ''}"
        }
    row = json.loads(result.stdout.splitlines()[-1])
    lines = result.stderr.splitlines()
    if row["outcome"] == "refused":
        row["outcome"] = (
            lines[0][:150] if len(lines) == 1 else f"{len(lines)} lines: {lines[-1][:120]}"
        )
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="Checkout to run the cases in.")
    parser.add_argument("--timeout", type=float, default=60, help="Seconds per case (default: 60).")
    parser.add_argument(
        "--memory-gb", type=float, default=4, help="Address-space cap per case (default: 4)."
    )
    parser.add_argument("--only", default=None, help="Run the cases whose name contains this text.")
    args = parser.parse_args()
    print("| case | seconds | peak RSS MB (added) | outcome |\n|---|---|---|---|")
    with tempfile.TemporaryDirectory() as directory:
        for name, (kind, value) in CASES.items():
            if args.only and args.only not in name:
                continue
            row = run_case(kind, value, args.root, Path(directory), args.timeout, args.memory_gb)
            seconds = f"{row['seconds']:.2f}" if "seconds" in row else "-"
            memory = f"{row['rss_mb']} (+{row['added_mb']})" if "rss_mb" in row else "-"
            print(f"| {name} | {seconds} | {memory} | {row['outcome']} |", flush=True)


if __name__ == "__main__":
    main()
