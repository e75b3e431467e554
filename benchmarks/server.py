"""Our server (python -m server) against mlx_lm.server on the same model directory, side by side.

    flock /tmp/bench.lock python -m benchmarks.server --repeats 3

Starts three servers on free local ports: mlx_lm.server, ours, ours with --prompt-lookup. Both
sides load the fast BLAS (mlx_lm.server through a two-line wrapper), so they run the same matmuls.
Requests go one at a time with the openai client, streaming, temperature 0, and the servers take
turns on every prompt (repeats interleaved). Reported: time to first token (TTFT, first non-empty
text chunk) and decoding speed ((tokens - 1) / (last chunk - first chunk), as mlx-lm counts it),
best of the repeats (other work on a shared machine only ever slows a request down).

Tasks: plain chat; an extractive question over a document (prompt lookup); JSON output with a
schema (ours constrains it; mlx_lm.server has no response_format, so it gets the schema in the
prompt and we count valid outputs); and a multi-turn conversation over a document, where both
servers reuse their prompt cache, and ours is also timed cold on the same prompts.
"""

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "benchmarks" / "prompts"
MLX_LM_SERVER = (
    "from loading import fast_blas; fast_blas.load(); import sys; from mlx_lm.server import main; "
    "sys.argv[0] = 'mlx_lm.server'; main()"
)
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
        "title": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 30},
        "phone": {"type": "string", "maxLength": 20},
    },
    "required": ["name", "quantity", "title", "city", "phone"],
}
FOLLOW_UPS = [
    "When did the museum open?",
    "Who founded it?",
    "What is the oldest engine called?",
    "When is the museum open?",
    "How much do tickets cost?",
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(name: str, command: list, port: int, model: str):
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    from openai import OpenAI

    client = OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600
    )
    server = {"name": name, "process": process, "client": client, "model": model}
    for _ in range(600):
        try:
            # Ready when it answers (mlx_lm.server's /v1/models fails without a Hugging Face cache).
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
            )
            return server
        except Exception:
            if process.poll() is not None:
                raise SystemExit(f"error: {name} exited while starting ({' '.join(command)})")
            time.sleep(0.5)
    raise SystemExit(f"error: {name} did not start")


def timed_chat(server, messages, max_tokens, **extra) -> dict:
    """One streamed request: TTFT, decoding tok/s, the text and the token count."""
    start_time = time.perf_counter()
    first = last = None
    pieces, usage = [], None
    stream = server["client"].chat.completions.create(
        model=server["model"],
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        text = chunk.choices[0].delta.content if chunk.choices else None
        if text:
            last = time.perf_counter()
            first = first or last
            pieces.append(text)
    tokens = usage.completion_tokens if usage else len(pieces)
    decode_time = (last or start_time) - (first or start_time)
    return {
        "ttft": (first or time.perf_counter()) - start_time,
        "tokens": tokens,
        "text": "".join(pieces),
        "tps": (tokens - 1) / decode_time if tokens > 1 and decode_time > 0 else 0.0,
        "cached": getattr(getattr(usage, "prompt_tokens_details", None), "cached_tokens", None),
        "prompt_tokens": usage.prompt_tokens if usage else None,
        # ours: the target passes the request took part in (usage.decoding)
        "passes": ((usage.model_extra or {}).get("decoding") or {}).get("target_forward_passes")
        if usage
        else None,
    }


def user(text: str, nonce: str) -> list:
    # A system message that differs per repeat: neither server's prompt cache can skip the prefill.
    return [
        {"role": "system", "content": f"You are a helpful assistant (run {nonce})."},
        {"role": "user", "content": text},
    ]


def single_turn_tasks(servers, repeats, max_tokens):
    plain = [(PROMPTS / "open_ended" / "explain.txt").read_text()]
    grounded = [(PROMPTS / "extractive_qa" / "lighthouse.txt").read_text()]
    order = (ROOT / "demo" / "order.txt").read_text()
    schema_prompt = order + "\nUse this JSON schema: " + json.dumps(ORDER_SCHEMA)
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "order", "schema": ORDER_SCHEMA},
    }
    rows = {}
    for repeat in range(repeats):
        for task, prompts in (
            ("plain chat", plain),
            ("extractive QA (grounded)", grounded),
            ("JSON schema (order email)", [schema_prompt]),
        ):
            for index, prompt in enumerate(prompts):
                for server in servers:
                    extra = {}
                    if task.startswith("JSON") and server["name"] != "mlx_lm.server":
                        extra = {"response_format": response_format}
                    result = timed_chat(
                        server, user(prompt, f"{repeat}.{index}"), max_tokens, **extra
                    )
                    if task.startswith("JSON"):
                        result["valid"] = is_valid(result["text"])
                    rows.setdefault((task, server["name"]), []).append(result)
                    print(
                        f"{task} | {server['name']} | prompt {index} | TTFT {result['ttft']:.2f} s "
                        f"| {result['tps']:.1f} tok/s | {result['tokens']} tokens",
                        flush=True,
                    )
    return rows


def is_valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), ORDER_SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def multi_turn(servers, repeats, num_turns):
    """A conversation over a document: the history grows, each new turn is one short question."""
    document = (ROOT / "demo" / "museum.txt").read_text()
    rows = []
    for repeat in range(repeats):
        for server in servers:
            messages = [
                {"role": "system", "content": f"Answer briefly from the document (run {repeat})."},
                {"role": "user", "content": document},
            ]
            for turn, question in enumerate(FOLLOW_UPS[:num_turns]):
                if turn:
                    messages.append({"role": "user", "content": question})
                warm = timed_chat(server, messages, 24)
                row = {
                    "server": server["name"],
                    "turn": turn + 1,
                    "ttft": warm["ttft"],
                    "prompt_tokens": warm["prompt_tokens"],
                    "cached": warm["cached"],
                }
                # the same prompt again after another conversation evicted it
                if server["name"] == "ours":
                    timed_chat(server, user("Say hi.", f"evict {repeat}.{turn}"), 1)
                    row["cold_ttft"] = timed_chat(server, messages, 1)["ttft"]
                rows.append(row)
                messages.append({"role": "assistant", "content": warm["text"]})
                print(f"multi-turn | {server['name']} | turn {turn + 1} | {row}", flush=True)
    return rows


def report(single, turns, repeats) -> str:
    lines = []
    if single:
        lines += [
            "| task | server | TTFT (s) | decode tok/s | tokens | valid JSON |",
            "|---|---|---:|---:|---:|---:|",
        ]
    for (task, name), results in single.items():
        valid = (
            f"{sum(r['valid'] for r in results)}/{len(results)}" if "valid" in results[0] else ""
        )
        lines.append(
            f"| {task} | {name} | {min(r['ttft'] for r in results):.2f} | "
            f"{max(r['tps'] for r in results):.1f} | "
            f"{statistics.median(r['tokens'] for r in results):.0f} | {valid} |"
        )
    lines += [
        "",
        "| turn | prompt tokens | mlx_lm.server: cached | TTFT (s) | ours: cached | TTFT (s) | "
        "ours, cache evicted: TTFT (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for turn in sorted({r["turn"] for r in turns}):
        theirs = [r for r in turns if r["turn"] == turn and r["server"] == "mlx_lm.server"]
        ours = [r for r in turns if r["turn"] == turn and r["server"] == "ours"]
        lines.append(
            f"| {turn} | {ours[0]['prompt_tokens']} | {theirs[0]['cached']} | "
            f"{min(r['ttft'] for r in theirs):.2f} | {ours[0]['cached']} | "
            f"{min(r['ttft'] for r in ours):.2f} | {min(r['cold_ttft'] for r in ours):.2f} |"
        )
    return "\n".join(lines) + f"\n\nBest of {repeats} repeats.\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="Also write the tables to this file.")
    parser.add_argument(
        "--max-tokens", type=int, default=128, help="Tokens per single-turn answer (default: 128)."
    )
    parser.add_argument(
        "--turns", type=int, default=len(FOLLOW_UPS), help="Turns of the conversation (default: 5)."
    )
    args = parser.parse_args()
    from loading.load import default_model_path

    model_dir = str(default_model_path())
    ports = [free_port() for _ in range(3)]
    servers = [
        start(
            "mlx_lm.server",
            [
                sys.executable,
                "-c",
                MLX_LM_SERVER,
                "--model",
                model_dir,
                "--port",
                str(ports[0]),
                "--log-level",
                "ERROR",
            ],
            ports[0],
            "default_model",
        ),
        start(
            "ours",
            [sys.executable, "-m", "server", "--model", model_dir, "--port", str(ports[1])],
            ports[1],
            model_dir,
        ),
        start(
            "ours --prompt-lookup",
            [
                sys.executable,
                "-m",
                "server",
                "--model",
                model_dir,
                "--port",
                str(ports[2]),
                "--prompt-lookup",
            ],
            ports[2],
            model_dir,
        ),
    ]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the finally below under `timeout`
    try:
        for server in servers:  # warm-up: the first MLX call of a process is slow
            timed_chat(server, user("Hi", "warm-up"), 4)
        # The multi-turn table first, written as soon as it is done.
        turns = multi_turn(servers[:2], args.repeats, args.turns)
        write(args.out, report({}, turns, args.repeats))
        single = single_turn_tasks(servers, args.repeats, args.max_tokens)
        write(args.out, report(single, turns, args.repeats))
    finally:
        for server in servers:
            server["process"].terminate()


def write(path, table: str):
    print(table, flush=True)
    if path:
        Path(path).write_text(table)


if __name__ == "__main__":
    main()
