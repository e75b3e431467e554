"""Sharded decoding on localhost: communication per verify pass, tok/s for 1-3 ranks, lookup savings.

    python -m benchmarks.distributed            # launches every configuration with mlx.launch

For each configuration (1 process; 2 ranks pipeline; 3 ranks tensor; 3 ranks
pipeline) one launch decodes the same code-editing prompt with plain decoding
and with prompt lookup (interleaved after a warm-up), then times the
collectives of one verify pass on their own. The last table is a *model*:
tokens/s per link latency from the measured passes/token and compute time.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PROMPT = ROOT / "benchmarks" / "prompts" / "code_edit" / "inventory.txt"
CONFIGS = [(1, "single"), (2, "pipeline"), (3, "tensor"), (3, "pipeline")]
LATENCIES_MS = [0.05, 0.2, 1.0, 5.0]


def median_ms(fn, repeats: int = 20) -> float:
    import mlx.core as mx

    mx.eval(fn())  # warm-up
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - tic)
    return 1e3 * statistics.median(times)


def collective_costs(model, group) -> dict:
    """Milliseconds for the messages of one single-token verify pass, timed without the layers."""
    import mlx.core as mx

    from distributed.sharding import broadcast

    rank, size = group.rank(), group.size()
    hidden = mx.zeros((1, 1, model.args.hidden_size))
    logits = mx.zeros((1, 1, model.args.vocab_size))

    def pipeline_messages():  # the hidden state hops rank to rank, then the logits are broadcast
        h = hidden if rank == 0 else mx.distributed.recv_like(hidden, rank - 1, group=group)
        if rank < size - 1:
            h = mx.distributed.send(h, rank + 1, group=group)
        return broadcast(mx.depends(logits, h), size - 1, group)

    return {
        "all_reduce_hidden_ms": median_ms(lambda: mx.distributed.all_sum(hidden, group=group)),
        "broadcast_logits_ms": median_ms(lambda: broadcast(logits, 0, group)),
        "pipeline_messages_ms": median_ms(pipeline_messages),
    }


def worker(mode: str, max_tokens: int):
    import mlx.core as mx

    import distributed
    import main
    from decoder import generate

    session = distributed.start()
    base = ["--prompt-file", str(PROMPT), "--max-tokens", str(max_tokens)] + (
        ["--shard", mode] if session else [])
    methods = {"plain": base, "prompt lookup": base + ["--prompt-lookup"]}
    record = {"ranks": session.size if session else 1, "mode": mode, "methods": {}}
    for warm_up in (True, False):  # fresh models and sources each round: draft sources keep state
        runs = {name: main.build_run(main.build_parser().parse_args(argv), session) for name, argv in methods.items()}
        for name, (model, tokenizer, prompt, kwargs) in runs.items():
            result = generate(model, tokenizer, prompt, **dict(kwargs, max_tokens=4 if warm_up else max_tokens))
            passes = result.stats.target_forward_passes
            record["methods"][name] = {
                "tps": result.generation_tps, "tokens": result.generation_tokens,
                "passes_per_token": passes / max(result.generation_tokens, 1),
                # decode seconds per verify pass (the first token's pass is prefill's)
                "pass_ms": 1e3 * (result.generation_tokens - 1) / max(result.generation_tps, 1e-9) / max(passes - 1, 1),
            }
    if session:
        model = runs["plain"][0]
        record["num_layers"] = len(model.layers) if mode == "tensor" else None
        record.update(collective_costs(model, session.group))
    mx.eval(mx.zeros(1))
    print(json.dumps(record), flush=True)


def launch(ranks: int, mode: str, max_tokens: int) -> dict:
    command = [sys.executable, __file__, "--worker", mode, "--max-tokens", str(max_tokens)]
    if ranks > 1:
        launcher = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or "mlx.launch"
        command = [launcher, "-n", str(ranks), "--backend", "ring", "--"] + command
    result = subprocess.run(command, stdin=subprocess.PIPE, capture_output=True, text=True, cwd=ROOT,
                            env=os.environ.copy())
    if result.returncode != 0 or not result.stdout.strip():
        raise SystemExit(f"{ranks} ranks, {mode}: {result.stderr.strip()}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def tables(records: list) -> str:
    lines = ["| ranks | sharding | method | tok/s | vs 1 process | passes/token | ms/pass | "
             "collectives ms/pass |", "|---:|---|---|---:|---:|---:|---:|---:|"]
    single = records[0]["methods"]
    for record in records:
        comm = "-"
        if record["mode"] == "tensor":
            comm = f"{2 * record['num_layers'] * record['all_reduce_hidden_ms'] + record['broadcast_logits_ms']:.2f}"
        elif record["mode"] == "pipeline":
            comm = f"{record['pipeline_messages_ms']:.2f}"
        for name, method in record["methods"].items():
            lines.append(f"| {record['ranks']} | {record['mode']} | {name} | {method['tps']:.2f} | "
                         f"{method['tps'] / single[name]['tps']:.2f}x | {method['passes_per_token']:.3f} | "
                         f"{method['pass_ms']:.1f} | {comm} |")
    lines += ["", "Collectives, each timed alone (median of 20, ms):", "",
              "| ranks | sharding | all-reduce of one hidden state | logits broadcast (1 position) | "
              "pipeline hops + broadcast |", "|---:|---|---:|---:|---:|"]
    for record in records[1:]:
        lines.append(f"| {record['ranks']} | {record['mode']} | {record['all_reduce_hidden_ms']:.3f} | "
                     f"{record['broadcast_logits_ms']:.3f} | {record['pipeline_messages_ms']:.3f} |")
    return "\n".join(lines)


def latency_model(records: list, num_layers: int) -> str:
    """A MODEL, not a measurement: time/token = passes/token x (compute/pass + rounds/pass x latency)."""
    single = records[0]["methods"]
    # Two machines: pipeline = one hop + the logits broadcast; tensor = two all-reduces per layer + broadcast.
    rounds = {"pipeline": 2, "tensor": 2 * num_layers + 1}
    lines = ["| latency per round (ms) | " + " | ".join(
        f"{mode} {name} ({rounds[mode]} rounds/pass)" for mode in rounds for name in single) + " |",
        "|---:|" + "---:|" * (len(rounds) * len(single))]
    for latency in LATENCIES_MS:
        cells = []
        for mode, count in rounds.items():
            for name, method in single.items():
                compute = method["pass_ms"] / (2 if mode == "tensor" else 1)  # tensor: ideal halving
                ms_per_token = method["passes_per_token"] * (compute + count * latency)
                cells.append(f"{1e3 / ms_per_token:.1f}")
        lines.append(f"| {latency:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--max-tokens", type=int, default=48, help="Tokens per run (default: 48).")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "distributed.md"))
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.max_tokens)
    records = []
    for ranks, mode in CONFIGS:
        records.append(launch(ranks, mode, args.max_tokens))
        print(json.dumps(records[-1]), flush=True)  # partial results survive a timeout
    num_layers = next(r["num_layers"] for r in records if r["mode"] == "tensor")
    text = (f"{tables(records)}\n\n**Model, not a measurement**: two machines, tokens/s = 1 / (passes/token x "
            f"(compute/pass + rounds/pass x latency)), with this machine's one-process compute per pass "
            f"(each method's own; halved for tensor) and measured passes/token:\n\n"
            f"{latency_model(records, num_layers)}\n")
    print(text)
    Path(args.output).write_text(f"# Distributed (sharded target)\n\n`python -m benchmarks.distributed "
                                 f"--max-tokens {args.max_tokens}`\n\n{text}")


if __name__ == "__main__":
    main()
