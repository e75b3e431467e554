"""Many clients at once: our batching server against mlx_lm.server (batching on), side by side.

    flock /tmp/cpu.lock python -m benchmarks.server_load [--clients 1 2 4 8 16] [--max-tokens 40]

Starts the servers on free local ports, each loading the fast BLAS: mlx_lm.server, ours one request
at a time (``--max-batch 1``, what the server did before it batched), ours batching and ours
batching with ``--prompt-lookup`` (the one-at-a-time server on chat only). At each client count N, N
clients send one streamed greedy request each at the same moment, and the servers take turns on the
same prompts. Reported per server: aggregate tok/s (every completion token over the round's wall
time, prefill included), p50/p95 time per output token per request (after its first token), and time
to first token.

Workloads: chat (benchmarks/heldout/chat.txt); grounded (document questions, code edits, quote
summaries); json (JSON from a short request, benchmarks/json_schemas/suite) and extract (fields out
of a document, benchmarks/json_schemas/extraction) through ``response_format``; mix (chat, grounded
and extract in turn). The last three run on ours only, since mlx_lm.server has no
``response_format``. Every prompt carries a system line unique to its round, so no server's prompt
cache can skip the prefill.

Then ``--conversations`` conversations over documents run interleaved, a turn of each in turn, on
mlx_lm.server and ours: time to first token per turn, against the prompt's length and what the
prompt cache held.

``--apis`` instead runs ours alone on the chat workload, each client count twice at once: every
client through chat completions, then the clients in turn through chat completions, Anthropic's
Messages and OpenAI's Responses (streamed, greedy, the same prompts), to show that the three APIs
share one batch at no cost (results/server_apis.md):

    flock /tmp/cpu.lock python -m benchmarks.server_load --apis --clients 8 --repeats 3
"""

import argparse
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.batch import percentile
from benchmarks.json_schema import schema_requests
from benchmarks.server import FOLLOW_UPS, MLX_LM_SERVER, ROOT, free_port, start, timed_chat

BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results" / "server_load.md"
APIS_RESULTS = BENCH / "results" / "server_apis.md"  # --apis


def workloads():
    chat = [
        line for line in (BENCH / "heldout" / "chat.txt").read_text().splitlines() if line.strip()
    ]
    grounded = [
        file.read_text()
        for folder in ("extractive_qa", "code_edit", "summarize_quotes")
        for file in sorted((BENCH / "prompts" / folder).glob("*.txt"))
    ]
    work = {
        "chat": [(text, {}) for text in chat],
        "grounded": [(text, {}) for text in grounded],
        "json": schema_work("suite"),
        "extract": schema_work("extraction"),
    }
    count = min(len(work[name]) for name in ("chat", "grounded", "extract"))
    work["mix"] = [work[("chat", "grounded", "extract")[i % 3]][i // 3] for i in range(3 * count)]
    return work


def schema_work(folder: str) -> list:
    """(prompt, extra request fields) for each schema in benchmarks/json_schemas/``folder``."""
    return [
        (
            text,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "out", "schema": schema},
                }
            },
        )
        for text, schema in schema_requests(folder)
    ]


def timed_stream(events, text_of, tokens_of) -> dict:
    """timed_chat's measures for another API's stream: ``text_of(event)`` is its new text or None,
    ``tokens_of(event)`` its completion token count or None."""
    start_time = time.perf_counter()
    first = last = None
    pieces, tokens = [], None
    for event in events:
        if text := text_of(event):
            last = time.perf_counter()
            first = first or last
            pieces.append(text)
        tokens = tokens_of(event) or tokens
    tokens = tokens or len(pieces)
    decode_time = (last or start_time) - (first or start_time)
    return {
        "ttft": (first or time.perf_counter()) - start_time,
        "tokens": tokens,
        "text": "".join(pieces),
        "tps": (tokens - 1) / decode_time if tokens > 1 and decode_time > 0 else 0.0,
    }


def timed_api(server, api: str, messages: list, max_tokens: int) -> dict:
    """One streamed greedy request through ``api``: "chat", "messages" (Anthropic) or
    "responses"."""
    if api == "chat":
        return timed_chat(server, messages, max_tokens)
    system, user = messages[0]["content"], messages[1:]
    if api == "messages":
        import anthropic

        client = anthropic.Anthropic(
            base_url=str(server["client"].base_url).rstrip("/").removesuffix("/v1"),
            api_key="none",
            max_retries=0,
            timeout=600,
        )
        events = client.messages.create(
            model=server["model"],
            system=system,
            messages=user,
            max_tokens=max_tokens,
            stream=True,
            extra_body={"temperature": 0},
        )
        return timed_stream(
            events,
            lambda e: e.delta.text if e.type == "content_block_delta" else None,
            lambda e: e.usage.output_tokens if e.type == "message_delta" else None,
        )
    events = server["client"].responses.create(
        model=server["model"],
        instructions=system,
        input=user,
        max_output_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    return timed_stream(
        events,
        lambda e: e.delta if e.type == "response.output_text.delta" else None,
        lambda e: e.response.usage.output_tokens if e.type == "response.completed" else None,
    )


def round_of(server, requests, nonce, max_tokens, apis=("chat",)) -> dict:
    """Send ``requests`` at once (request i through ``apis[i % len(apis)]``); aggregate tok/s and
    each request's timings."""

    def one(index):
        text, extra = requests[index]
        messages = [
            {"role": "system", "content": f"You are a helpful assistant (round {nonce}.{index})."},
            {"role": "user", "content": text},
        ]
        if extra:
            return timed_chat(server, messages, max_tokens, **extra)
        return timed_api(server, apis[index % len(apis)], messages, max_tokens)

    start_time = time.perf_counter()
    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(one, range(len(requests))))
    seconds = time.perf_counter() - start_time
    per_token = [1 / r["tps"] for r in results if r["tps"] > 0]
    return {
        "tps": sum(r["tokens"] for r in results) / seconds,
        "per_token": per_token,
        "ttft": [r["ttft"] for r in results],
        "tokens": sum(r["tokens"] for r in results),
    }


def load_table(servers, work, clients, repeats, max_tokens) -> list:
    lines = [
        "| workload | clients | server | tok/s in all | vs mlx_lm.server | vs ours one at a time | "
        "p50 ms/token | p95 ms/token | p50 TTFT (s) | tokens |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for workload, prompts in work.items():
        for count in clients:
            requests = [prompts[i % len(prompts)] for i in range(count)]
            best = {}
            for repeat in range(repeats):  # servers interleaved; the best round of each counts
                for server in servers:
                    if workload in ("json", "extract", "mix") and server["name"] == "mlx_lm.server":
                        continue  # no response_format there
                    if workload != "chat" and server["name"] == "ours, one at a time":
                        continue  # the old server's baseline, on chat only (it is slow to run)
                    result = round_of(server, requests, f"{workload}.{count}.{repeat}", max_tokens)
                    name, tps = server["name"], result["tps"]
                    print(f"  round {repeat + 1}: {name} {tps:.1f} tok/s", flush=True)
                    if server["name"] not in best or result["tps"] > best[server["name"]]["tps"]:
                        best[server["name"]] = result
            theirs = best.get("mlx_lm.server", {}).get("tps")
            single = best.get("ours, one at a time", {}).get("tps")
            for name, result in best.items():
                ratio = f"{result['tps'] / theirs:.2f}x" if theirs else ""
                versus = f"{result['tps'] / single:.2f}x" if single else ""
                lines.append(
                    f"| {workload} | {count} | {name} | {result['tps']:.1f} | {ratio} | {versus} | "
                    f"{1e3 * percentile(result['per_token'], 0.5):.0f} | "
                    f"{1e3 * percentile(result['per_token'], 0.95):.0f} | "
                    f"{percentile(result['ttft'], 0.5):.2f} | {result['tokens']} |"
                )
                print(lines[-1], flush=True)
    return lines


def api_table(server, prompts, clients, repeats, max_tokens) -> list:
    """Chat completions alone against chat, Messages and Responses mixed, on one server, in turn."""
    lines = [
        "| clients | requests through | tok/s in all | vs chat alone "
        "| p50 ms/token | p50 TTFT (s) | tokens |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    mixes = {
        "chat completions": ("chat",),
        "chat, Messages, Responses in turn": ("chat", "messages", "responses"),
    }
    for count in clients:
        requests = [prompts[i % len(prompts)] for i in range(count)]
        best = {}
        for repeat in range(repeats):  # interleaved; the best round of each counts
            for name, apis in mixes.items():
                result = round_of(server, requests, f"apis.{count}.{repeat}", max_tokens, apis)
                if name not in best or result["tps"] > best[name]["tps"]:
                    best[name] = result
        alone = best["chat completions"]["tps"]
        for name, result in best.items():
            lines.append(
                f"| {count} | {name} | {result['tps']:.1f} | {result['tps'] / alone:.2f}x | "
                f"{1e3 * percentile(result['per_token'], 0.5):.0f} | "
                f"{percentile(result['ttft'], 0.5):.2f} | {result['tokens']} |"
            )
            print(lines[-1], flush=True)
    return lines


def conversations(servers, count, turns) -> list:
    """``count`` conversations over documents, one turn of each in turn: TTFT per turn."""
    documents = [(ROOT / "demo" / "museum.txt").read_text()] + [
        f.read_text() for f in sorted((BENCH / "prompts" / "extractive_qa").glob("*.txt"))
    ]
    lines = [
        "| server | turn | prompt tokens (mean) | cached tokens (mean) | TTFT (s, mean) |",
        "|---|---:|---:|---:|---:|",
    ]
    for server in servers:
        histories = [
            [
                {
                    "role": "system",
                    "content": f"Answer briefly from the document (conversation {c}).",
                },
                {"role": "user", "content": documents[c % len(documents)]},
            ]
            for c in range(count)
        ]
        for turn in range(turns):
            results = []
            for history in histories:
                if turn:
                    history.append({"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]})
                result = timed_chat(server, history, 16)
                history.append({"role": "assistant", "content": result["text"]})
                results.append(result)
            lines.append(
                f"| {server['name']} | {turn + 1} | "
                f"{statistics.mean(r['prompt_tokens'] for r in results):.0f} | "
                f"{statistics.mean(r['cached'] or 0 for r in results):.0f} | "
                f"{statistics.mean(r['ttft'] for r in results):.2f} |"
            )
            print(lines[-1], flush=True)
    return lines


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=["chat", "grounded", "json", "extract", "mix"],
        choices=["chat", "grounded", "json", "extract", "mix"],
    )
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--conversations", type=int, default=4, help="Interleaved conversations (0: skip)"
    )
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument(
        "--apis",
        action="store_true",
        help="Ours alone, chat: chat completions against chat, Messages and Responses mixed",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="Markdown file for the tables ('' to skip; default: "
        "benchmarks/results/server_load.md, with --apis server_apis.md)",
    )
    return parser.parse_args()


def server_specs(model_dir: str, most: int, apis: bool) -> list:
    """(name, command) of each server compared, sized for ``most`` clients at once."""
    ours = [sys.executable, "-m", "server", "--model", model_dir, "--max-queue", str(2 * most)]
    mlx_lm_server = [sys.executable, "-c", MLX_LM_SERVER, "--model", model_dir]
    mlx_lm_server += ["--log-level", "ERROR"]
    mlx_lm_server += ["--decode-concurrency", str(most), "--prompt-concurrency", str(most)]
    specs = [
        ("mlx_lm.server", mlx_lm_server),
        ("ours, one at a time", ours + ["--max-batch", "1"]),
        ("ours", ours + ["--max-batch", str(most)]),
        ("ours --prompt-lookup", ours + ["--max-batch", str(most), "--prompt-lookup"]),
        # trees are the default (--tree-nodes auto); chains alone, to see what trees cost or win
        (
            "ours --prompt-lookup --tree-nodes 0",
            ours + ["--max-batch", str(most), "--prompt-lookup", "--tree-nodes", "0"],
        ),
    ]
    return [spec for spec in specs if spec[0] == "ours"] if apis else specs


def report(servers: list, args) -> list:
    """The results file's lines: the command, then the tables ``args`` asks for."""
    command = (
        f"python -m benchmarks.server_load --clients {' '.join(map(str, args.clients))} "
        f"--workloads {' '.join(args.workloads)} --max-tokens {args.max_tokens} "
        f"--repeats {args.repeats} --conversations {args.conversations} --turns {args.turns}"
    )
    lines = [
        "# Many clients at once",
        "",
        f"    {command}",
        "",
        f"Greedy, at most {args.max_tokens} tokens per request, the embedded SmolLM2-135M "
        "(float32), every server with the fast BLAS; best of the repeats.",
        "",
    ]
    if args.apis:
        lines[2] = (
            f"    {command.split(' --workloads')[0]} --apis --max-tokens {args.max_tokens} "
            f"--repeats {args.repeats}"
        )
        return lines + api_table(
            servers[0], workloads()["chat"], args.clients, args.repeats, args.max_tokens
        )
    work = {name: prompts for name, prompts in workloads().items() if name in args.workloads}
    lines += load_table(servers, work, args.clients, args.repeats, args.max_tokens)
    if args.conversations:
        lines += [
            "",
            f"{args.conversations} conversations interleaved (a turn of each in turn):",
            "",
        ]
        lines += conversations([servers[0], servers[2]], args.conversations, args.turns)
    return lines


def main():
    args = parse_args()
    from loading.load import default_model_path

    model_dir = str(default_model_path())
    servers = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the finally below under `timeout`
    try:
        for name, command in server_specs(model_dir, max(args.clients), args.apis):
            port = free_port()
            model_id = "default_model" if name == "mlx_lm.server" else model_dir
            servers.append(start(name, command + ["--port", str(port)], port, model_id))
            # the first MLX call is slow
            timed_chat(servers[-1], [{"role": "user", "content": "Hi"}], 4)
        lines = report(servers, args)
        out = args.out if args.out is not None else str(APIS_RESULTS if args.apis else RESULTS)
        if out:
            Path(out).write_text("\n".join(lines) + "\n")
    finally:
        for server in servers:
            server["process"].terminate()
            server["process"].wait(timeout=30)


if __name__ == "__main__":
    main()
