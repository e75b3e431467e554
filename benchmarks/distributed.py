"""Sharded decoding on localhost: communication per verify pass, tok/s for 1-3 ranks, drafting
savings.

    python -m benchmarks.distributed                        # every configuration on localhost
    python -m benchmarks.distributed --configs 3:tensor     # one of them; the tables combine the
    parts python -m benchmarks.distributed --logit-difference     # tensor-sharded logits vs one
    process's

For each configuration (1 process; 2 ranks pipeline; 3 ranks tensor; 3 ranks
pipeline) one launch decodes a code-editing prompt and a held-out chat prompt
with plain decoding, prompt lookup, the draft head and both (one after another
after a warm-up), then times the collectives of one verify pass on their own,
and the two ways of giving every rank the hidden states and logits. The last
table is a *model*: tokens/s per link latency from the measured passes/token and
compute time.
"""

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The ranks run this file as a script (launch() below), so they do not import the benchmarks
# package, which loads the fast BLAS: each rank loads it itself before mlx.core.
sys.path.insert(0, str(ROOT))

from loading import fast_blas  # noqa: E402

# Prompt lookup's case (an edit that copies most of the code) and the draft head's (chat it was not
# trained on).
PROMPTS = {
    "code edit": [
        "--prompt-file",
        str(ROOT / "benchmarks" / "prompts" / "code_edit" / "inventory.txt"),
    ],
    "held-out chat": [
        "--prompt",
        (ROOT / "benchmarks" / "heldout" / "chat.txt").read_text().splitlines()[0],
    ],
}
CONFIGS = [(1, "single"), (2, "pipeline"), (3, "tensor"), (3, "pipeline")]
LATENCIES_MS = [0.05, 0.2, 1.0, 5.0]
METHODS = {
    "plain": [],
    "prompt lookup": ["--prompt-lookup"],
    "draft head": ["--draft-head"],
    "lookup + head": ["--prompt-lookup", "--draft-head"],
}
VERIFY_POSITIONS = (1, 5)  # a plain step; a step verifying a 4-token draft


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
    """Milliseconds for the messages of one verify pass, timed without the layers.

    Per verify width L: the all-reduce of L hidden states (what tensor sharding does twice per
    layer, and what broadcasts the final hidden states), the pipeline's hop plus that broadcast,
    and the alternative to broadcasting hidden states and applying the output head on every
    rank: applying it on one rank and broadcasting hidden states and logits together.
    """
    import mlx.core as mx

    from distributed.sharding import broadcast

    rank, size = group.rank(), group.size()
    head = model.model.embed_tokens.as_linear  # SmolLM2 ties its output head to the embedding
    costs = {}
    for positions in VERIFY_POSITIONS:
        hidden = mx.random.normal((1, positions, model.args.hidden_size))
        width = model.args.hidden_size + model.args.vocab_size

        def pipeline_messages():  # the hidden state hops rank to rank, then it is broadcast
            h = hidden if rank == 0 else mx.distributed.recv_like(hidden, rank - 1, group=group)
            if rank < size - 1:
                h = mx.distributed.send(h, rank + 1, group=group)
            return broadcast(mx.depends(hidden, h), size - 1, group)

        # the alternative: rank 0 sends hidden states and logits in one message
        def head_on_one_rank():
            both = (
                mx.concatenate([hidden, head(hidden)], axis=-1)
                if rank == 0
                else mx.zeros((1, positions, width))
            )
            return broadcast(both, 0, group)

        costs[positions] = {
            "all_reduce_hidden_ms": median_ms(lambda: mx.distributed.all_sum(hidden, group=group)),
            "pipeline_messages_ms": median_ms(pipeline_messages),
            "head_on_every_rank_ms": median_ms(lambda: head(broadcast(hidden, 0, group))),
            "head_on_one_rank_ms": median_ms(head_on_one_rank),
        }
    return costs


def worker(mode: str, max_tokens: int):
    fast_blas.load()  # before mlx.core
    import mlx.core as mx

    import distributed
    import main
    from decoder import generate

    session = distributed.start(set_blas_threads=fast_blas.set_num_threads)
    options = ["--max-tokens", str(max_tokens)] + (["--shard", mode] if session else [])
    runs = [
        (f"{prompt_name}: {method}", prompt + options + flags)
        for prompt_name, prompt in PROMPTS.items()
        for method, flags in METHODS.items()
    ]
    record = {
        "ranks": session.size if session else 1,
        "mode": mode,
        "methods": {},
        "blas_threads": fast_blas.num_threads(),
    }
    # A warm-up of 4 tokens per method, then every run; a fresh model and sources each run
    # (draft sources keep state).
    for warm_up, (name, argv) in [(True, run) for run in runs[: len(METHODS)]] + [
        (False, run) for run in runs
    ]:
        args = main.build_parser().parse_args(argv)
        main.validate(args)
        model, tokenizer, prompt, kwargs = main.build_run(args, session)
        result = generate(
            model, tokenizer, prompt, **dict(kwargs, max_tokens=4 if warm_up else max_tokens)
        )
        passes = result.stats.target_forward_passes
        record["methods"][name] = {
            "tps": result.generation_tps,
            "tokens": result.generation_tokens,
            "passes_per_token": passes / max(result.generation_tokens, 1),
            # decode seconds per verify pass (the first token's pass is prefill's)
            "pass_ms": 1e3
            * (result.generation_tokens - 1)
            / max(result.generation_tps, 1e-9)
            / max(passes - 1, 1),
        }
    if session:
        args = main.build_parser().parse_args(runs[0][1])
        main.validate(args)
        model = main.build_run(args, session)[0]
        record["num_layers"] = len(model.layers) if mode == "tensor" else None
        record["collectives"] = collective_costs(model, session.group)
    mx.eval(mx.zeros(1))
    print(json.dumps(record), flush=True)


def logit_difference():
    """How far 3 tensor ranks' logits are from one process's on the code-edit prompt, beside the
    smallest gap between a position's top two logits (a flip needs a gap below the difference)."""
    fast_blas.load()
    import mlx.core as mx

    import distributed
    from loading.load import load_model

    session = distributed.start(set_blas_threads=fast_blas.set_num_threads)
    whole, tokenizer, _ = load_model()
    tokens = mx.array(tokenizer.encode(Path(PROMPTS["code edit"][1]).read_text()))[None]
    reference = whole(tokens)
    logits = session.shard(load_model(None, lazy=True)[0], "tensor")(tokens)
    mx.eval(logits, reference)  # on every rank: the sharded pass is collective
    difference = mx.abs(logits - reference).reshape(-1)
    top_two = mx.sort(reference[0], axis=-1)[:, -2:]
    print(
        json.dumps(
            {
                "positions": tokens.shape[1],
                "max_difference": difference.max().item(),
                "median_difference": mx.sort(difference)[difference.size // 2].item(),
                "max_logit": mx.abs(reference).max().item(),
                "smallest_top_two_gap": (top_two[:, 1] - top_two[:, 0]).min().item(),
                "same_argmax": mx.array_equal(logits.argmax(-1), reference.argmax(-1)).item(),
            }
        ),
        flush=True,
    )


@contextlib.contextmanager
def local_hostfile(ranks: int):
    """The path of a ring hostfile for ``ranks`` ranks on free local ports, as ``mlx.launch``
    writes one."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(ranks)]
        for probe in sockets:
            probe.bind(("127.0.0.1", 0))  # the system picks free ports
        hosts = [[f"127.0.0.1:{probe.getsockname()[1]}"] for probe in sockets]
    with tempfile.NamedTemporaryFile("w", suffix=".json") as hostfile:
        json.dump(hosts, hostfile)
        hostfile.flush()
        yield hostfile.name


def rank_environment(hostfile: str, rank: int) -> dict:
    return dict(os.environ, MLX_HOSTFILE=hostfile, MLX_RANK=str(rank))


def start_ranks(ranks: int, command: list) -> subprocess.CompletedProcess:
    """Start ``ranks`` ring ranks on localhost as ``mlx.launch`` does (a hostfile and MLX_RANK),
    minus its launcher process: that one's thread per rank polls the rank's always-writable stdin
    pipe and keeps a core partly busy, a large share of a small machine (see
    results/distributed.md)."""
    with local_hostfile(ranks) as hostfile:
        processes = [
            subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env=rank_environment(hostfile, rank),
            )
            for rank in range(ranks)
        ]
        outputs = [process.communicate() for process in processes]
    failed = next((process.returncode for process in processes if process.returncode), 0)
    return subprocess.CompletedProcess(
        command, failed, outputs[0][0], "".join(err for _, err in outputs)
    )


def launch(ranks: int, mode: str, max_tokens: int, launcher: str = "direct") -> dict:
    command = [sys.executable, __file__, "--worker", mode, "--max-tokens", str(max_tokens)]
    if ranks > 1 and launcher == "direct":
        result = start_ranks(ranks, command)
    else:
        if ranks > 1:
            mlx_launch = (
                shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or "mlx.launch"
            )
            command = [mlx_launch, "-n", str(ranks), "--backend", "ring", "--"] + command
        result = subprocess.run(
            command,
            stdin=subprocess.PIPE,
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=os.environ.copy(),
        )
    if result.returncode != 0 or not result.stdout.strip():
        raise SystemExit(f"{ranks} ranks, {mode}: {result.stderr.strip()}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def tables(records: list) -> str:
    lines = [
        "| ranks | sharding | method | tok/s | vs 1 process | passes/token | ms/pass | "
        "collectives ms/pass |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    single = records[0]["methods"]
    for record in records:
        comm = "-"
        if record["mode"] != "single":
            one = record["collectives"]["1"]
            # tensor: two all-reduces per layer, then the final hidden states' broadcast (an
            # all-reduce too)
            comm = (
                f"{(2 * record['num_layers'] + 1) * one['all_reduce_hidden_ms']:.2f}"
                if record["mode"] == "tensor"
                else f"{one['pipeline_messages_ms']:.2f}"
            )
        for name, method in record["methods"].items():
            lines.append(
                f"| {record['ranks']} | {record['mode']} | {name} | {method['tps']:.2f} | "
                f"{method['tps'] / single[name]['tps']:.2f}x | {method['passes_per_token']:.3f} | "
                f"{method['pass_ms']:.1f} | {comm} |"
            )
    lines += [
        "",
        "Collectives, each timed alone (median of 20, ms), for a verify pass of 1 and 5 positions:",
        "",
        "| ranks | sharding | positions | all-reduce of the hidden states | pipeline hops + "
        "broadcast | broadcast hidden, head on every rank | head on one rank, broadcast hidden + "
        "logits |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for record in records[1:]:
        for positions, cost in record["collectives"].items():
            lines.append(
                f"| {record['ranks']} | {record['mode']} | {positions} | "
                f"{cost['all_reduce_hidden_ms']:.3f} | {cost['pipeline_messages_ms']:.3f} | "
                f"{cost['head_on_every_rank_ms']:.3f} | {cost['head_on_one_rank_ms']:.3f} |"
            )
    return "\n".join(lines)


def latency_model(records: list, num_layers: int) -> str:
    """A MODEL, not a measurement: time/token = passes/token x (compute/pass + rounds/pass x
    latency)."""
    single = records[0]["methods"]
    # Two machines: pipeline = one hop + the hidden states' broadcast; tensor = two all-reduces per
    # layer + broadcast.
    rounds = {"pipeline": 2, "tensor": 2 * num_layers + 1}
    lines = [
        "| method | passes/token | compute ms/pass | "
        + " | ".join(f"{mode}, {latency:g} ms" for mode in rounds for latency in LATENCIES_MS)
        + " |",
        "|---|---:|---:|" + "---:|" * (len(rounds) * len(LATENCIES_MS)),
    ]
    for name, method in single.items():
        cells = []
        for mode, count in rounds.items():
            for latency in LATENCIES_MS:
                # tensor: ideal halving
                compute = method["pass_ms"] / (2 if mode == "tensor" else 1)
                cells.append(
                    f"{1e3 / (method['passes_per_token'] * (compute + count * latency)):.1f}"
                )
        lines.append(
            f"| {name} | {method['passes_per_token']:.3f} | {method['pass_ms']:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def report(records: list) -> str:
    num_layers = next(r["num_layers"] for r in records if r["mode"] == "tensor")
    return (
        f"{tables(records)}\n\n**Model, not a measurement**: two machines, tokens/s = 1 / "
        "(passes/token x (compute/pass + rounds/pass x latency)), with this machine's one-process "
        "compute per pass (each method's own; halved for tensor), measured passes/token, 2 rounds "
        f"per pass for pipeline and {2 * num_layers + 1} for "
        f"tensor:\n\n{latency_model(records, num_layers)}\n"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--max-tokens", type=int, default=48, help="Tokens per run (default: 48).")
    parser.add_argument(
        "--configs",
        default=",".join(f"{ranks}:{mode}" for ranks, mode in CONFIGS),
        help="Which to launch, as ranks:sharding (default: all four). Launch them in parts "
        "to keep each run short: the tables combine every configuration in --records.",
    )
    parser.add_argument(
        "--logit-difference",
        action="store_true",
        help="Only compare 3 tensor ranks' logits with one process's (near-ties).",
    )
    parser.add_argument(
        "--launcher",
        choices=["direct", "mlx.launch"],
        default="direct",
        help="Start localhost ranks directly (default) or through mlx.launch.",
    )
    parser.add_argument(
        "--records",
        default=str(ROOT / "benchmarks" / "results" / "distributed.jsonl"),
        help="JSON lines, one per configuration; a new run replaces its configuration's line.",
    )
    args = parser.parse_args()
    if args.worker == "logits":
        return logit_difference()
    if args.worker:
        return worker(args.worker, args.max_tokens)
    if args.logit_difference:
        return print(
            start_ranks(3, [sys.executable, __file__, "--worker", "logits"]).stdout.strip()
        )
    path = Path(args.records)
    records = {}
    if path.exists():
        records = {
            (r["ranks"], r["mode"]): r for r in map(json.loads, path.read_text().splitlines())
        }
    for config in args.configs.split(","):
        ranks, mode = config.split(":")
        record = dict(
            launch(int(ranks), mode, args.max_tokens, args.launcher),
            max_tokens=args.max_tokens,
            launcher=args.launcher,
        )
        records[(record["ranks"], mode)] = record
        path.write_text(
            "".join(json.dumps(records[key]) + "\n" for key in CONFIGS if key in records)
        )
        print(json.dumps(record), flush=True)
    if all(key in records for key in CONFIGS):
        print(report([records[key] for key in CONFIGS]))


if __name__ == "__main__":
    main()
