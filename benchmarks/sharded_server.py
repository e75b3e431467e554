"""The server on a sharded target: 8 concurrent requests against one at a time, and against
mlx_lm.server sharded the same way.

    flock /tmp/mlxdec-test.lock python -m benchmarks.sharded_server [--rounds 2] [--max-tokens 32]

For 2 ranks (pipeline) and 3 ranks (tensor) on localhost, it starts each server in turn, round after
round: ours plain, ours with ``--prompt-lookup`` and mlx_lm.server (``--pipeline`` for pipeline
sharding), all with the fast BLAS. The ranks are started directly, as ``mlx.launch`` starts them
(a hostfile and MLX_RANK), without its launcher process, which keeps half a core busy (see
docs/distributed.md); mlx_lm.server's ranks get the same share of the cores for their BLAS as ours
take by themselves. Each server answers the same 8 grounded requests (document questions, code
edits, quote summaries; greedy, streamed) at once, and ours plain also one at a time. Reported:
tok/s in all (every completion token over the wall time, prefill included), time to first token and
passes per token.

``--message-cost`` instead times what a step's message costs: ``server.ranks.Lockstep.share`` with
no news (one scalar all-reduce) and with a joining request, on 2 and 3 ranks.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.distributed import local_hostfile, rank_environment
from benchmarks.server import MLX_LM_SERVER, ROOT, free_port, timed_chat
from benchmarks.server_load import workloads

RESULTS = ROOT / "benchmarks" / "results" / "sharded_server.md"
CONFIGS = [(2, "pipeline"), (3, "tensor")]
LOG = Path(tempfile.gettempdir()) / "sharded_server.log"  # the ranks' stderr


@contextlib.contextmanager
def ranks_running(ranks: int, command: list, log=None):
    """``ranks`` ring ranks of ``command`` on localhost; all are stopped on the way out. Their
    stderr goes to ``log`` (a file), or nowhere."""
    with local_hostfile(ranks) as hostfile:
        processes = [
            subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                stderr=log or subprocess.DEVNULL,
                text=True,
                cwd=ROOT,
                env=rank_environment(hostfile, rank),
            )
            for rank in range(ranks)
        ]
        try:
            yield processes
        finally:
            for process in processes:
                process.kill()
                process.wait()


def server_commands(model_dir: str, ranks: int, mode: str, port: int) -> dict:
    ours = [sys.executable, "-m", "server", "--model", model_dir, "--port", str(port)]
    ours += ["--shard", mode, "--max-batch", "8", "--max-queue", "16"]
    # mlx_lm.server does not split the cores between ranks on one host; ours does
    # (distributed.share_cores): give its BLAS the same share.
    threads = max(1, len(os.sched_getaffinity(0)) // ranks)
    theirs = ["env", f"OPENBLAS_NUM_THREADS={threads}", sys.executable, "-c", MLX_LM_SERVER]
    theirs += ["--model", model_dir, "--port", str(port)]
    theirs += ["--log-level", "ERROR", "--decode-concurrency", "8", "--prompt-concurrency", "8"]
    return {
        "ours": ours,
        "ours --prompt-lookup": ours + ["--prompt-lookup"],
        "mlx_lm.server": theirs + (["--pipeline"] if mode == "pipeline" else []),
    }


def client_for(port: int, model: str, name: str) -> dict:
    from openai import OpenAI

    client = OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=1200
    )
    seen = None
    for _ in range(1200):
        try:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
            )
            return {"name": name, "client": client, "model": model}
        except Exception as error:  # not listening yet, or loading
            if repr(error) != seen:
                seen = repr(error)
                print(f"{name}: {seen}", file=sys.stderr, flush=True)
            time.sleep(0.5)
    raise SystemExit(f"error: {name} did not start")


def messages_of(text: str, nonce: str) -> list:
    # a system line unique to the round: no server's prompt cache can skip the prefill
    return [
        {"role": "system", "content": f"You are a helpful assistant (round {nonce})."},
        {"role": "user", "content": text},
    ]


def send(server, requests, nonce, max_tokens, at_once: bool) -> dict:
    """The requests all at once or one after another: tok/s in all, time to first token and
    passes per token (ours)."""
    start = time.perf_counter()

    def one(index):
        return timed_chat(server, messages_of(requests[index][0], f"{nonce}.{index}"), max_tokens)

    if at_once:
        with ThreadPoolExecutor(len(requests)) as pool:
            results = list(pool.map(one, range(len(requests))))
    else:
        results = [one(index) for index in range(len(requests))]
    tokens = sum(r["tokens"] for r in results)
    passes = [r["passes"] for r in results]
    return {
        "tps": tokens / (time.perf_counter() - start),
        "ttft": [r["ttft"] for r in results],
        "tokens": tokens,
        "passes_per_token": None if None in passes else sum(passes) / tokens,
    }


def measure(args) -> list:
    """One record per (config, server, way, round)."""
    from loading.load import default_model_path

    model_dir = str(default_model_path())
    requests = workloads()["grounded"][: args.requests]
    records = []
    for ranks, mode in CONFIGS:
        for repeat in range(args.rounds):
            # mlx-lm 0.32 pipelines only models with its PipelineMixin (not Llama): for SmolLM2
            # mlx_lm.server stops with "The model does not support pipelining".
            names = ["ours", "ours --prompt-lookup"] + (
                ["mlx_lm.server"] if mode == "tensor" else []
            )
            for name in names:
                port = free_port()
                command = server_commands(model_dir, ranks, mode, port)[name]
                model = "default_model" if name == "mlx_lm.server" else model_dir
                with open(LOG, "a") as log, ranks_running(ranks, command, log):
                    server = client_for(port, model, name)
                    nonce = f"{ranks}{mode}{repeat}{name}"
                    ways = {"at once": True, "one at a time": False}
                    if name != "ours":
                        del ways["one at a time"]
                    for way, at_once in ways.items():
                        result = send(server, requests, nonce + way, args.max_tokens, at_once)
                        records.append(
                            {"ranks": ranks, "mode": mode, "server": name, "way": way,
                             "round": repeat, "tps": result["tps"], "tokens": result["tokens"],
                             "ttft": statistics.median(result["ttft"]),
                             "passes_per_token": result["passes_per_token"]}
                        )  # fmt: skip
                        print(json.dumps(records[-1]), flush=True)
    return records


def table(records: list, args) -> list:
    lines = [
        "| ranks | server | requests | tok/s in all (best of rounds) | vs ours one at a time | "
        "vs mlx_lm.server | median time to first token | passes per token |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for ranks, mode in CONFIGS:
        picked = [r for r in records if r["ranks"] == ranks and r["mode"] == mode]
        best = {}
        for record in picked:
            key = (record["server"], record["way"])
            if record["tps"] > best.get(key, {"tps": 0})["tps"]:
                best[key] = record
        serial = best.get(("ours", "one at a time"), {}).get("tps")
        theirs = best.get(("mlx_lm.server", "at once"), {}).get("tps")
        for (name, way), record in best.items():
            against = f"{record['tps'] / theirs:.2f}x" if theirs else "(refuses the model)"
            passes = record["passes_per_token"]
            lines.append(
                f"| {ranks} ({mode}) | {name} | {way} | {record['tps']:.1f} | "
                f"{record['tps'] / serial:.2f}x | {against} | {record['ttft']:.2f} s | "
                f"{'-' if passes is None else f'{passes:.3f}'} |"
            )
    return lines


def message_worker(repeats: int = 200):
    """Run on every rank: the median cost of ``Lockstep.share`` with and without news."""
    from loading import fast_blas

    fast_blas.load()
    import distributed
    from decoder import Sampling
    from server.ranks import Lockstep
    from server.request import GenerationRequest

    session = distributed.start(60.0)
    lockstep = Lockstep(session)
    request = GenerationRequest(
        prompt=list(range(1000)), max_tokens=256, sampling=Sampling(0.7), stop=["\n\n"]
    )
    news = {"none": None, "a 1000-token request joins": ([request], [], False)}
    costs = {}
    for name, message in news.items():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            lockstep.share(message if session.rank == 0 else None)
            times.append(time.perf_counter() - start)
        costs[name] = statistics.median(times) * 1e3
    if session.rank == 0:
        print(json.dumps(costs), flush=True)


def message_costs() -> list:
    lines = ["| ranks | no news (ms) | a 1000-token request joins (ms) |", "|---|---:|---:|"]
    for ranks in (2, 3):
        command = [sys.executable, "-m", "benchmarks.sharded_server", "--message-worker"]
        with ranks_running(ranks, command) as processes:
            out, _ = processes[0].communicate(timeout=600)
            for process in processes[1:]:
                process.wait(timeout=60)
        costs = json.loads(out.strip().splitlines()[-1])
        lines.append(
            f"| {ranks} | {costs['none']:.3f} | {costs['a 1000-token request joins']:.3f} |"
        )
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--message-cost", action="store_true")
    parser.add_argument("--message-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if args.message_worker:
        return message_worker()
    if args.message_cost:
        print("\n".join(message_costs()))
        return
    records = measure(args)
    command = (
        f"python -m benchmarks.sharded_server --rounds {args.rounds} --requests {args.requests} "
        f"--max-tokens {args.max_tokens}"
    )
    lines = [
        "# The server on a sharded target",
        "",
        f"    {command}",
        "",
        f"{args.requests} grounded requests (benchmarks/prompts: document questions, code edits, "
        f"quote summaries), greedy, streamed, at most {args.max_tokens} tokens each, the embedded "
        "SmolLM2-135M (float32), ranks on localhost on this 2-core Linux VM, each server with the "
        "fast BLAS and one BLAS thread per rank share of the cores; best of the rounds, servers "
        "started in turn each round. Passes per token: the target passes each request took part "
        "in, over its tokens (ours only).",
        "",
    ]
    lines += table(records, args)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
