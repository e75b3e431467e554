"""Batched decoding side by side: mlx-lm's BatchGenerator and ours, plain and with drafts, at 1-16 rows.

    python -m benchmarks.batch [--sizes 1 2 4 8 16] [--max-tokens 64] [--workloads chat grounded json]

Workloads (greedy, the embedded SmolLM2-135M, chat template):
- chat: open questions (benchmarks/heldout/chat.txt);
- grounded: document questions, code edits and quote summaries (benchmarks/prompts), with prompt lookup;
- json: JSON Schema extraction (benchmarks/json_schemas/suite, the built-in regex compiler), with the
  forced text of the schema and prompt lookup.

At each batch size the methods run one after another on the same prompts (interleaved, so drift of
the machine hits them alike); each engine keeps one cost model across sizes, as a server would.
tok/s is every generated token over the wall time from insert to the last token (prefill included,
the same batched prefill for both engines); decode tok/s counts from the batch's first token, as
mlx-lm reports generation speed; ms/token is per request, from its first token to its last.
"""

import argparse
import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from batch import BatchGenerator
from cost import PassCost
from benchmarks.harness import PROMPTS, chat_tokens
from constrained import ForcedTextSource, RegexConstraint, schema_to_regex
from constrained.token_index import load_or_build_index
from decoder import eos_ids_of
from loading import cache_dir, describe_backend, load_model
from prompt_lookup.ngram import PromptLookupSource

ROOT = Path(__file__).parent
RESULTS = ROOT / "results" / "batch.md"


@dataclass
class Run:
    tokens: list  # per row, EOS included
    seconds: float
    latencies: list  # per row: seconds per token after the first
    decode_seconds: float  # from the first token of the batch to the last (prefill excluded)
    passes_per_token: float
    peak_gb: float
    widths: dict


def timed(step, uids, start):
    """Drive ``step() -> [(uid, tokens)]`` to the end, stamping each row's first and last token."""
    tokens, first, last = {uid: [] for uid in uids}, {}, {}
    decode_start = None
    while responses := step():
        now = time.perf_counter()
        decode_start = decode_start or now
        for uid, new in responses:
            if new:
                tokens[uid] += new
                first.setdefault(uid, now)
                last[uid] = now
    seconds = time.perf_counter() - start
    latencies = [(last[u] - first[u]) / (len(tokens[u]) - 1) for u in uids if len(tokens[u]) > 1]
    return [tokens[u] for u in uids], seconds, latencies, time.perf_counter() - decode_start


def run_mlx_lm(model, eos, prompts, max_tokens, _options):
    from mlx_lm.generate import BatchGenerator as MlxBatchGenerator

    mx.reset_peak_memory()
    start = time.perf_counter()
    generator = MlxBatchGenerator(model, stop_tokens=[[t] for t in eos], max_tokens=max_tokens,
                                  prefill_batch_size=len(prompts), completion_batch_size=len(prompts))
    uids = generator.insert(prompts, [max_tokens] * len(prompts))

    def step():
        return [(r.uid, [r.token]) for r in generator.next_generated()]
    tokens, seconds, latencies, decode = timed(step, uids, start)
    generator.close()
    return Run(tokens, seconds, latencies, decode, 1.0, mx.get_peak_memory() / 1e9, {1: "all"})


def run_ours(model, eos, prompts, max_tokens, options, cost):
    mx.reset_peak_memory()
    start = time.perf_counter()
    generator = BatchGenerator(model, eos_token_ids=eos, prefill_batch_size=len(prompts), pass_cost=cost)
    uids = generator.insert(prompts, max_tokens=max_tokens, **options())

    def step():
        return [(r.uid, r.tokens) for r in generator.next()]
    tokens, seconds, latencies, decode = timed(step, uids, start)
    stats = generator.stats
    return Run(tokens, seconds, latencies, decode, stats.row_passes / max(stats.generation_tokens, 1),
               mx.get_peak_memory() / 1e9, dict(sorted(stats.widths.items())))


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
        return sum(count * (self.base + self.per_token * (width - 1)) for width, count in widths.items())


def simulated(model, eos, prompts, max_tokens, options):
    """Tokens per simulated second and passes per token of the same policy on the cheap curve."""
    clocked = SimulatedClock(model)
    generator = BatchGenerator(clocked, eos_token_ids=eos, prefill_batch_size=len(prompts),
                               pass_cost=PassCost(clock=clocked.time))
    generator.insert(prompts, max_tokens=max_tokens, **options())
    while generator.next():
        pass
    stats = generator.stats
    return (stats.generation_tokens / clocked.seconds(stats.widths), stats.row_passes / stats.generation_tokens,
            dict(sorted(stats.widths.items())))


def load_workloads(tokenizer, vocab_size, names):
    grounded = [(f"{folder}/{file.stem}", file.read_text()) for folder in ("extractive_qa", "code_edit", "summarize_quotes")
                for file in sorted((PROMPTS / folder).glob("*.txt"))]
    chat = [line for line in (ROOT / "heldout" / "chat.txt").read_text().splitlines() if line.strip()]
    work = {}
    if "chat" in names:
        work["chat"] = ([chat_tokens(tokenizer, text) for text in chat], None)
    if "grounded" in names:
        work["grounded"] = ([chat_tokens(tokenizer, text) for _, text in grounded], None)
    if "json" in names:
        schemas = [json.loads(p.read_text()) for p in sorted((ROOT / "json_schemas" / "suite").glob("*.json"))]
        index_dir = cache_dir() / "regex-index"
        indexes = [load_or_build_index(schema_to_regex({k: v for k, v in s.items() if k != "_prompt"}), tokenizer,
                                       vocab_size, eos_ids_of(tokenizer), cache_dir=index_dir) for s in schemas]
        prompts = [chat_tokens(tokenizer, s["_prompt"] + " Answer with the JSON only.") for s in schemas]
        work["json"] = (prompts, indexes)
    return work


def methods_for(workload, indexes, tokenizer):
    """(name, options factory or None for mlx-lm) per method; factories build fresh per-row objects."""
    def lookup(rows):
        return lambda: {"draft_sources": [[PromptLookupSource()] for _ in range(rows)]}

    def constrained(rows, drafts):
        def make():
            constraints = [RegexConstraint(indexes[i % len(indexes)]) for i in range(rows)]
            sources = [[ForcedTextSource(c, tokenizer), PromptLookupSource()] if drafts else [] for c in constraints]
            return {"constraint": constraints, "draft_sources": sources}
        return make

    if workload == "json":
        return [("ours constrained", lambda rows: constrained(rows, False)),
                ("ours constrained + forced + lookup", lambda rows: constrained(rows, True))]
    return [("mlx-lm BatchGenerator", None), ("ours plain", lambda rows: lambda: {}),
            ("ours + prompt lookup", lookup)]


def pick(prompts, rows):
    """``rows`` prompts, cycling through the set when it has fewer."""
    return [prompts[i % len(prompts)] for i in range(rows)]


def percentile(values, share):
    values = sorted(values)
    return values[min(int(share * len(values)), len(values) - 1)] if values else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--workloads", nargs="+", default=["chat", "grounded", "json"],
                        choices=["chat", "grounded", "json"])
    parser.add_argument("--simulate-rows", type=int, default=8,
                        help="Also run grounded and json at this many rows on a simulated GPU-like cost curve (0: skip)")
    parser.add_argument("--out", default=str(RESULTS), help="Markdown file for the table ('' to skip)")
    args = parser.parse_args()

    model, tokenizer, _ = load_model()
    eos = eos_ids_of(tokenizer)
    work = load_workloads(tokenizer, model.args.vocab_size, args.workloads)
    costs = {}  # one cost model per method, kept across batch sizes
    warm = pick(work[args.workloads[0]][0], 2)
    run_mlx_lm(model, eos, warm, 8, None)
    run_ours(model, eos, warm, 8, lambda: {}, PassCost())

    lines = ["| workload | rows | method | tok/s | vs first | decode tok/s | vs first | passes/token "
             "| p50 ms/token | p95 ms/token | peak GB | widths (passes) |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    mismatches = []
    for workload, (prompts, indexes) in work.items():
        methods = methods_for(workload, indexes, tokenizer)
        for rows in args.sizes:
            batch_prompts = pick(prompts, rows)
            results = {}
            for name, factory in methods:
                if factory is None:
                    results[name] = run_mlx_lm(model, eos, batch_prompts, args.max_tokens, None)
                else:
                    cost = costs.setdefault((workload, name), PassCost())
                    results[name] = run_ours(model, eos, batch_prompts, args.max_tokens, factory(rows), cost)
            first = first_decode = None
            for name, run in results.items():
                total = sum(len(t) for t in run.tokens)
                tps = total / run.seconds
                # As mlx-lm counts decode speed: the tokens after each row's first.
                decode_tps = (total - rows) / run.decode_seconds
                first, first_decode = first or tps, first_decode or decode_tps
                lines.append(f"| {workload} | {rows} | {name} | {tps:.1f} | {tps / first:.2f}x | "
                             f"{decode_tps:.1f} | {decode_tps / first_decode:.2f}x | "
                             f"{run.passes_per_token:.3f} | {1e3 * percentile(run.latencies, 0.5):.0f} | "
                             f"{1e3 * percentile(run.latencies, 0.95):.0f} | {run.peak_gb:.3f} | {run.widths} |")
                print(lines[-1], flush=True)
            # Greedy: every method must give every row the same tokens (EOS aside, which mlx-lm drops).
            outputs = [[[t for t in row if t not in eos] for row in run.tokens] for run in results.values()]
            for name, output in zip(results, outputs):
                differing = sum(a != b for a, b in zip(output, outputs[0]))
                if differing:
                    mismatches.append(f"{workload} x{rows}: {name} differs from {next(iter(results))} on "
                                      f"{differing} of {rows} rows")
                    print("  !!", mismatches[-1], flush=True)
    simulated_lines = []
    if args.simulate_rows:
        simulated_lines = ["", f"Simulated GPU-like cost curve, {args.simulate_rows} rows: a [B, W] pass takes "
                           "1 + 0.005 (W - 1) time units at any B (the same policy, reading the simulated timings)",
                           "", "| workload | method | tokens per time unit | vs first | passes/token | widths (passes) |",
                           "|---|---|---:|---:|---:|---|"]
        for workload, (prompts, indexes) in work.items():
            if workload == "chat":
                continue
            first = None
            for name, factory in methods_for(workload, indexes, tokenizer):
                if factory is None:
                    continue
                rate, passes, widths = simulated(model, eos, pick(prompts, args.simulate_rows), args.max_tokens,
                                                 factory(args.simulate_rows))
                first = first or rate
                simulated_lines.append(f"| {workload} | {name} | {rate:.2f} | {rate / first:.2f}x | {passes:.3f} "
                                       f"| {widths} |")
                print(simulated_lines[-1], flush=True)
    if args.out:
        command = "python -m benchmarks.batch " + " ".join(
            [f"--sizes {' '.join(map(str, args.sizes))}", f"--max-tokens {args.max_tokens}",
             f"--workloads {' '.join(args.workloads)}", f"--simulate-rows {args.simulate_rows}"])
        header = [f"# Batched decoding ({platform.machine()}, {describe_backend()}, SmolLM2-135M float32, greedy, "
                  f"{args.max_tokens} tokens per request)", "", f"    {command}", ""]
        notes = [""] + ([f"- {m}" for m in mismatches] or ["- every method gave every row the same tokens"])
        Path(args.out).write_text("\n".join(header + lines + notes + simulated_lines) + "\n")


if __name__ == "__main__":
    main()
