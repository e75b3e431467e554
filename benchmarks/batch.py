"""Batched decoding side by side: mlx-lm's BatchGenerator and ours, plain and with drafts, at 1-16
rows.

    python -m benchmarks.batch [--sizes 1 2 4 8 16] [--max-tokens 64] [--workloads chat grounded
    json extract mix]

Workloads (greedy, the embedded SmolLM2-135M, chat template):
- chat: open questions (benchmarks/heldout/chat.txt);
- grounded: document questions, code edits and quote summaries (benchmarks/prompts), with prompt
  lookup;
- json: JSON written to a schema from a short request (benchmarks/json_schemas/suite, the built-in
  regex compiler), with the forced text of the schema and prompt lookup;
- extract: JSON Schema extraction, fields copied out of a document
  (benchmarks/json_schemas/extraction: emails, a posting, a report, a listing, an invoice, a
  biography), with the same sources;
- mix: chat, grounded and extract in turn (row i's kind is i % 3), each row with its own sources
  and constraint in one batch.

``--oracle`` adds to json and extract a bound, not a method: forced text drafted in exactly the
tokens the target then writes (read off the first method's output), with prompt lookup. What it
gains is the most any forced-text source can gain here under this width policy and this machine's
pass costs.

At each batch size the methods run one after another on the same prompts, ``--repeat`` times in
turn (A B C A B C), and each method's best run counts: on a shared machine other work only ever
slows a run down. Each engine keeps one cost model across sizes, as a server would.
The main rate counts the steps with every row in flight: a fixed batch ends with a tail of a few
rows (speculation spreads the rows' finishing times), which a server refills with new requests.
"insert to end" is every token over the whole run, prefill and tail included; ms/token is per
request, from its first token to its last. Each workload writes its section of the results file.
The workloads and the methods each runs are in batch_workloads.py.
"""

import argparse
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from batch import BatchGenerator
from benchmarks.batch_workloads import load_workloads, methods_for
from constrained.token_index import token_byte_strings
from decoder.pass_cost import PassCost
from decoder.text import eos_ids_of
from loading.load import describe_backend, load_model

ROOT = Path(__file__).parent
RESULTS = ROOT / "results" / "batch.md"


@dataclass
class Run:
    tokens: list  # per row, EOS included
    seconds: float  # from insert to the last token
    full_tps: float  # tokens per second over the steps with every row in flight (prefill excluded)
    latencies: list  # per row: seconds per token after its first
    passes_per_token: float
    peak_gb: float
    widths: dict


def timed(step, uids, start, clock=time.perf_counter, prefilled=None):
    """Drive ``step() -> [(uid, tokens)]`` to the end, stamping each row's first and last token.

    Rows finish at different times, and speculation spreads them further apart, so a fixed batch
    ends with a tail of a few rows; a server refills it. The steady rate counts only the steps
    with every row in flight and no prefill in them: not the first, nor one after which
    ``prefilled()`` is true (ours prefills prompts of different lengths in several groups).
    """
    tokens, first, last = {uid: [] for uid in uids}, {}, {}
    previous, full_tokens, full_time = None, 0, 0.0
    while responses := step():
        now = time.perf_counter()
        for uid, new in responses:
            if new:
                tokens[uid] += new
                first.setdefault(uid, now)
                last[uid] = now
        moment = clock()
        if previous is not None and len(responses) == len(uids) and not (prefilled and prefilled()):
            full_tokens += sum(len(new) for _, new in responses)
            full_time += moment - previous
        previous = moment
    seconds = time.perf_counter() - start
    latencies = [(last[u] - first[u]) / (len(tokens[u]) - 1) for u in uids if len(tokens[u]) > 1]
    return [tokens[u] for u in uids], seconds, full_tokens / max(full_time, 1e-9), latencies


def prefill_watch(generator):
    """A function that says whether ``generator`` prefilled since it was last asked."""
    seen = [generator.stats.prompt_time]

    def prefilled() -> bool:
        changed, seen[0] = generator.stats.prompt_time != seen[0], generator.stats.prompt_time
        return changed

    return prefilled


def run_mlx_lm(model, eos, prompts, max_tokens, _options):
    from mlx_lm.generate import BatchGenerator as MlxBatchGenerator

    mx.reset_peak_memory()
    start = time.perf_counter()
    generator = MlxBatchGenerator(
        model,
        stop_tokens=[[t] for t in eos],
        max_tokens=max_tokens,
        prefill_batch_size=len(prompts),
        completion_batch_size=len(prompts),
    )
    uids = generator.insert(prompts, [max_tokens] * len(prompts))

    def step():
        return [(r.uid, [r.token]) for r in generator.next_generated()]

    tokens, seconds, full_tps, latencies = timed(step, uids, start)
    generator.close()
    return Run(tokens, seconds, full_tps, latencies, 1.0, mx.get_peak_memory() / 1e9, {1: "all"})


def run_ours(model, eos, prompts, max_tokens, options, cost):
    mx.reset_peak_memory()
    start = time.perf_counter()
    generator = BatchGenerator(
        model, eos_token_ids=eos, prefill_batch_size=len(prompts), pass_cost=cost
    )
    uids = generator.insert(prompts, max_tokens=max_tokens, **options())

    def step():
        return [(r.uid, r.tokens) for r in generator.next()]

    tokens, seconds, full_tps, latencies = timed(
        step, uids, start, prefilled=prefill_watch(generator)
    )
    stats = generator.stats
    return Run(
        tokens,
        seconds,
        full_tps,
        latencies,
        stats.row_passes / max(stats.generation_tokens, 1),
        mx.get_peak_memory() / 1e9,
        dict(sorted(stats.widths.items())),
    )


class SimulatedClock:
    """The model on a simulated clock where a ``[B, W]`` pass takes ``base + per_token * (W - 1)``
    at any B: verification nearly free, as on a GPU (the curve of tests/test_cost.py)."""

    def __init__(self, model, base=1.0, per_token=0.005):
        self.model, self.layers, self.args = model, model.layers, model.args
        self.base, self.per_token, self.now = base, per_token, 0.0

    def __call__(self, inputs, cache=None):
        self.now += self.base + self.per_token * (inputs.shape[1] - 1)
        return self.model(inputs, cache=cache)

    def time(self) -> float:
        return self.now

    def seconds(self, widths: dict) -> float:
        return sum(
            count * (self.base + self.per_token * (width - 1)) for width, count in widths.items()
        )


def simulated(model, eos, prompts, max_tokens, options):
    """The same policy on the cheap curve: (tokens per time unit with every row in flight, passes
    per token, widths)."""
    clocked = SimulatedClock(model)
    generator = BatchGenerator(
        clocked,
        eos_token_ids=eos,
        prefill_batch_size=len(prompts),
        pass_cost=PassCost(clock=clocked.time),
    )
    uids = generator.insert(prompts, max_tokens=max_tokens, **options())
    _, _, full_rate, _ = timed(
        lambda: [(r.uid, r.tokens) for r in generator.next()],
        uids,
        0.0,
        clocked.time,
        prefill_watch(generator),
    )
    stats = generator.stats
    return full_rate, stats.row_passes / stats.generation_tokens, dict(sorted(stats.widths.items()))


def pick(prompts, rows):
    """``rows`` prompts, cycling through the set when it has fewer."""
    return [prompts[i % len(prompts)] for i in range(rows)]


def percentile(values, share):
    values = sorted(values)
    return values[min(int(share * len(values)), len(values) - 1)] if values else float("nan")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=["chat", "grounded", "json", "extract"],
        choices=["chat", "grounded", "json", "extract", "mix"],
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=2,
        help="Run the methods this many times in turn at each size and keep each one's best "
        "(a shared machine's noise only ever slows a run down)",
    )
    parser.add_argument(
        "--simulate-rows",
        type=int,
        default=8,
        help="Also run the workloads with drafts (all but chat) at this many rows on a simulated "
        "GPU-like cost curve (0: skip)",
    )
    parser.add_argument(
        "--oracle",
        action="store_true",
        help="Add to json and extract a bound: forced text drafted in the very tokens the target "
        "writes",
    )
    parser.add_argument(
        "--out", default=str(RESULTS), help="Markdown file for the table ('' to skip)"
    )
    return parser.parse_args()


def main():
    args = parse_args()
    model, tokenizer, _ = load_model()
    eos = eos_ids_of(tokenizer)
    work = load_workloads(tokenizer, model.args.vocab_size, args.workloads)
    costs = {}  # one cost model per method, kept across batch sizes
    token_bytes = token_byte_strings(tokenizer, model.args.vocab_size) if args.oracle else None
    warm = pick(work[args.workloads[0]][0], 2)
    run_mlx_lm(model, eos, warm, 8, None)
    run_ours(model, eos, warm, 8, lambda: {}, PassCost())

    sections = {}
    for workload, (prompts, indexes) in work.items():
        lines = [
            f"## {workload}",
            "",
            "| rows | method | tok/s, all rows in flight | vs first | vs ours without drafts "
            "| tok/s, insert to end | passes/token | p50 ms/token | p95 "
            "ms/token | peak GB | widths (passes) |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        mismatches = []
        truths = {}  # rows -> (prompts, the first method's output), for --oracle
        oracle = (token_bytes, truths) if args.oracle else None
        methods = methods_for(workload, indexes, tokenizer, oracle)
        for rows in args.sizes:
            batch_prompts = pick(prompts, rows)
            results = {}
            for _ in range(args.repeat):  # A B C A B C: the best run of each counts
                for name, factory in methods:
                    if factory is None:
                        run = run_mlx_lm(model, eos, batch_prompts, args.max_tokens, None)
                    else:
                        cost = costs.setdefault((workload, name), PassCost())
                        run = run_ours(
                            model, eos, batch_prompts, args.max_tokens, factory(rows), cost
                        )
                    if name not in results or run.full_tps > results[name].full_tps:
                        results[name] = run
                    truths.setdefault(rows, (batch_prompts, run.tokens))
            first = next(iter(results.values())).full_tps
            plain = next(run for name, run in results.items() if name.startswith("ours")).full_tps
            for name, run in results.items():
                total = sum(len(t) for t in run.tokens)
                lines.append(
                    f"| {rows} | {name} | {run.full_tps:.1f} | {run.full_tps / first:.2f}x | "
                    f"{run.full_tps / plain:.2f}x | {total / run.seconds:.1f} "
                    f"| {run.passes_per_token:.3f} | {1e3 * percentile(run.latencies, 0.5):.0f} | "
                    f"{1e3 * percentile(run.latencies, 0.95):.0f} "
                    f"| {run.peak_gb:.3f} | {run.widths} |"
                )
                print(workload, lines[-1], flush=True)
            mismatches += differing_rows(results, eos, rows)
        lines += [""] + (
            [f"- {m}" for m in mismatches] or ["- every method gave every row the same tokens"]
        )
        if args.simulate_rows and workload != "chat":
            lines += simulated_section(model, eos, prompts, methods, args, workload)
        command = (
            f"python -m benchmarks.batch --workloads {workload} --sizes "
            f"{' '.join(map(str, args.sizes))} --max-tokens {args.max_tokens} --repeat "
            f"{args.repeat} --simulate-rows {args.simulate_rows}"
            + (" --oracle" if args.oracle and workload in ("json", "extract") else "")
        )
        lines[1:1] = ["", f"    {command}"]
        sections[f"## {workload}"] = "\n".join(lines)
    if args.out:
        write_sections(Path(args.out), sections, args.max_tokens)


def differing_rows(results: dict, eos, rows: int) -> list:
    """Greedy: every method must give every row the same tokens (EOS aside, which mlx-lm drops).
    One line per method that does not."""
    mismatches = []
    outputs = [[[t for t in row if t not in eos] for row in run.tokens] for run in results.values()]
    for name, output in zip(results, outputs):
        differing = sum(a != b for a, b in zip(output, outputs[0]))
        if differing:
            mismatches.append(
                f"{rows} rows: {name} differs from {next(iter(results))} on "
                f"{differing} of {rows} rows"
            )
            print("  !!", mismatches[-1], flush=True)
    return mismatches


def simulated_section(model, eos, prompts, methods, args, workload) -> list:
    """The table of the drafting methods at ``args.simulate_rows`` rows on the simulated cost
    curve."""
    lines = [
        "",
        f"The same policy on a simulated GPU-like cost curve, {args.simulate_rows} rows: a [B, W] "
        "pass takes 1 + 0.005 (W - 1) time units at any B.",
        "",
        "| method | tokens per time unit, all rows in flight | vs first | passes/token | widths "
        "(passes) |",
        "|---|---:|---:|---:|---|",
    ]
    first = None
    for name, factory in methods:
        if factory is None or name.startswith("bound"):
            continue
        rate, passes, widths = simulated(
            model,
            eos,
            pick(prompts, args.simulate_rows),
            args.max_tokens,
            factory(args.simulate_rows),
        )
        first = first or rate
        lines.append(f"| {name} | {rate:.2f} | {rate / first:.2f}x | {passes:.3f} | {widths} |")
        print(workload, lines[-1], flush=True)
    return lines


def write_sections(out: Path, sections: dict, max_tokens: int):
    """Replace this run's sections of ``out``, keeping the others (other workloads,
    benchmarks.batch_cache's)."""
    kept = {}
    if out.exists():
        for part in ("\n" + out.read_text()).split("\n## ")[1:]:
            kept["## " + part.split("\n", 1)[0]] = ("## " + part).rstrip()
    kept.update(sections)
    header = (
        f"# Batched decoding\n\n{platform.machine()}, {describe_backend()}; SmolLM2-135M float32 "
        f"(the embedded model), greedy, {max_tokens} tokens per request at most. At each batch "
        "size the methods run one after another on the same prompts; each engine keeps one cost "
        "model across sizes.\n"
    )
    order = [f"## {w}" for w in ("chat", "grounded", "json", "extract")]
    body = [kept[k] for k in order if k in kept] + [v for k, v in kept.items() if k not in order]
    out.write_text(header + "\n" + "\n\n".join(body) + "\n")


if __name__ == "__main__":
    main()
