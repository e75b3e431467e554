"""OpenAI's ``n`` (issue #50): one request with n=4 against 4 separate requests, sent at once and
one at a time, through the server's engine (no HTTP) on the embedded model.

    flock /tmp/mlxdec-test.lock python -m benchmarks.choices

Each mode (and n=4 with each row prefilling the prompt, as before rows shared a prefill) asks
for the same 4 sampled answers (temperature 0.7, choice i seeded with seed + i, so the 4 separate
requests carry seeds seed..seed+3 and give the same tokens as the n=4 choices) to an
extractive_qa prompt, with no prompt cache (every request prefills), the modes interleaved over
rounds. Time to first token: from sending to a choice's first text, averaged over the 4; total:
until the last one is done. Writes benchmarks/results/choices.md.
"""

import argparse
import asyncio
import statistics
import time
from dataclasses import replace
from pathlib import Path

import batch.generator as generator
from batch.row import shared_prompts
from benchmarks.harness import load_prompts
from server.choices import choice_requests
from server.protocol import check_prompt, parse_completion

RESULTS = Path(__file__).parent / "results" / "choices.md"
MODEL_ID = "embedded"
CHOICES = 4


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args()


async def timed(engine, groups: list) -> tuple:
    """Send each group of requests, the next when the previous is done: a group of several with
    ``submit_together`` (one request's choices) or, as a list of groups of one sent at once
    (``groups`` of one group of lists), as separate clients. Returns (mean time to a request's
    first text, total seconds, each request's tokens)."""
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    firsts, tokens = [], []

    async def follow(job):
        first = None
        while True:
            kind, payload = await job.events.get()
            if kind == "text" and first is None:
                first = time.perf_counter() - start
                firsts.append(first)
            elif kind == "error":
                raise payload
            elif kind == "done":
                tokens.append(payload.tokens)
                return

    for group in groups:
        if isinstance(group[0], list):  # separate clients at once
            jobs = [engine.submit(request, loop) for (request,) in group]
        else:
            jobs = engine.submit_together(group, loop, [None] * len(group))
        await asyncio.gather(*(follow(job) for job in jobs))
    return statistics.mean(firsts), time.perf_counter() - start, tokens


def apart(rows: list) -> tuple:
    """``shared_prompts`` as it was before rows shared a prefill: every row prefills its own."""
    return list(range(len(rows))), list(range(len(rows)))


def main():
    args = parse_args()
    from loading.load import load_model
    from server.engine import Engine

    model, tokenizer, _ = load_model(None)
    vocab_size = model.args.vocab_size
    engine = Engine(model, tokenizer, vocab_size, max_batch=8, keep_caches=False)
    prompt = load_prompts(tokenizer, ["extractive_qa"])["extractive_qa"][0][1]
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.7, "seed": 11}
    request = parse_completion(body, tokenizer, MODEL_ID, args.max_tokens)
    check_prompt(request, None, vocab_size)
    # the n choices, and the same requests (seeds seed + i) sent as separate n=1 requests
    choices = choice_requests(replace(request, num_choices=CHOICES))
    modes = {
        "n=4 (one request)": [choices],
        "n=4, each row prefilling the prompt": [choices],
        "4 requests at once": [[[replace(r, num_choices=1)] for r in choices]],
        "4 requests one at a time": [[replace(r, num_choices=1)] for r in choices],
    }
    asyncio.run(timed(engine, [choices[:1]]))  # warm up
    results, outputs = {name: [] for name in modes}, {}
    for _ in range(args.rounds):
        for name, groups in modes.items():
            unshared = name.startswith("n=4, each row")
            generator.shared_prompts = apart if unshared else shared_prompts
            ttft, total, tokens = asyncio.run(timed(engine, groups))
            results[name].append((ttft, total))
            outputs.setdefault(name, sorted(tokens))
    generator.shared_prompts = shared_prompts
    same = len({tuple(map(tuple, tokens)) for tokens in outputs.values()}) == 1
    write(results, args, len(prompt), same)


def write(results: dict, args, prompt_tokens: int, same: bool):
    base = statistics.median(total for _, total in results["4 requests at once"])
    lines = [
        "# n=4 against 4 separate requests (issue #50)",
        "",
        "Command: `flock /tmp/mlxdec-test.lock .venv/bin/python -m benchmarks.choices "
        f"--max-tokens {args.max_tokens} --rounds {args.rounds}`",
        "",
        f"Embedded SmolLM2-135M-Instruct, the server's engine in one process (no HTTP), "
        f"a 2-core Linux CPU (shared); an extractive_qa prompt of {prompt_tokens} tokens, "
        f"{args.max_tokens} tokens per answer at temperature 0.7, no prompt cache, no drafts; "
        f"medians of {args.rounds} interleaved rounds. Every mode gave the same 4 answers: "
        f"{'yes' if same else 'no'}.",
        "",
        "| mode | time to first token (s, mean of 4) | total (s) | total vs 4 at once |",
        "|---|---:|---:|---:|",
    ]
    for name, runs in results.items():
        ttft = statistics.median(t for t, _ in runs)
        total = statistics.median(t for _, t in runs)
        lines.append(f"| {name} | {ttft:.2f} | {total:.2f} | {total / base:.2f}x |")
    lines += [
        "",
        "n=4 prefills the prompt once and copies its cache to the 4 rows. Separate requests with "
        "one prompt that join in the same step share the prefill too (batch.row.shared_prompts); "
        "sent at once, they join in one step when they reach the queue before the worker's next "
        "step.",
    ]
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
