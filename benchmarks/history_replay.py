"""Replay study: would drafting from the model's own past outputs save target passes?

    flock /tmp/bench.lock python -m benchmarks.history_replay --store-prompts 208

Under greedy decoding a model-free source's acceptance follows from logged outputs, with
no model run: walk each logged answer as the loop would, let the source propose from what
it has seen, accept the longest common prefix with the true continuation, and count one
target pass per step (covering the accepted tokens plus the target's own). The sources are
the real ``PromptLookupSource`` objects, so this is the pass count greedy decoding with them
gives, adaptive draft lengths included (capped at 16 tokens).

- prompt lookup: the query's prompt and its text so far.
- + history: ``HistoryLookupSource``, the same search with a store of earlier answers as
  older context, at several store sizes.

Cost model: verifying k draft tokens costs ``DRAFT_TOKEN_COST * k`` of a step on top of the
step (the embedded model's measured figure, benchmarks/results/README.md), so the modelled
speed-up is ``tokens / (passes + DRAFT_TOKEN_COST * drafted)``; the search is reported apart.
Data (generated once, cached): benchmarks/history_data.py.
"""

import argparse
import statistics
import time
from pathlib import Path

from benchmarks.history_data import query_set, store_answers
from prompt_lookup import PromptLookupSource
from prompt_lookup.history import HistoryLookupSource, join_outputs

DRAFT_TOKEN_COST = 0.09
RESULTS = Path(__file__).parent / "results" / "history.md"


def with_history(context, **options):
    """Prompt lookup over ``context`` (earlier answers) too, with no bound on the store."""
    return HistoryLookupSource(context, max_history_tokens=max(len(context), 1), **options)


def replay(source, prompt: list, answer: list, max_tokens: int) -> dict:
    """Walk ``answer`` as ``generate_step`` would with ``source``; count passes and drafted
    tokens."""
    source.reset()
    tokens = list(prompt)
    passes = drafted = generated = 0
    search_times = []
    while generated < len(answer):
        draft, max_draft = [], max_tokens - generated - 1
        if max_draft > 0:  # as in the loop: never draft past max_tokens
            tic = time.perf_counter()
            proposal = source.propose(tokens, max_draft)
            search_times.append(time.perf_counter() - tic)
            draft = proposal.tokens if proposal is not None else []
        truth = answer[generated : generated + len(draft)]
        accepted = next((i for i, (a, b) in enumerate(zip(draft, truth)) if a != b), len(truth))
        passes += 1
        drafted += len(draft)
        emitted = answer[generated : generated + accepted + 1]
        tokens += emitted
        generated += len(emitted)
        if generated < len(answer):
            source.update(tokens, len(draft), accepted if draft else 0)
    return {"tokens": len(answer), "passes": passes, "drafted": drafted, "search": search_times}


def totals(runs: list) -> dict:
    tokens = sum(r["tokens"] for r in runs)
    passes = sum(r["passes"] for r in runs)
    drafted = sum(r["drafted"] for r in runs)
    search = [t for r in runs for t in r["search"]]
    return {
        "tokens": tokens,
        "passes": passes,
        "saved": 1 - passes / tokens,
        "modelled": tokens / (passes + DRAFT_TOKEN_COST * drafted),
        "search_ms": 1e3 * statistics.median(search),
    }


def row(workload: str, method: str, store_tokens, result: dict, baseline: dict) -> str:
    fewer = 1 - result["passes"] / baseline["passes"]
    return (
        f"| {workload} | {method} | {store_tokens} | {result['tokens']} | {result['passes']} | "
        f"{result['saved']:.1%} | {fewer:+.1%} | {result['modelled']:.2f}x | "
        f"{result['search_ms']:.2f} |"
    )


def chat_study(queries, store, sizes, max_tokens, variants) -> list:
    lines = []
    baseline = totals([replay(PromptLookupSource(), p, a, max_tokens) for p, a in queries])
    lines.append(row("held-out chat", "prompt lookup", 0, baseline, baseline))
    for size in sizes:
        # The most recent answers that fit, as a store that drops its oldest would hold.
        kept, count = [], 0
        for answer in reversed(store):
            if count + len(answer) > size:
                break
            kept.insert(0, answer)
            count += len(answer)
        context = join_outputs(kept)
        for name, options in variants.items():
            result = totals(
                [replay(with_history(context, **options), p, a, max_tokens) for p, a in queries]
            )
            lines.append(row("held-out chat", name, len(context), result, baseline))
    return lines


def repeated_study(workload, queries, store, max_tokens, variants, warmup: int = 3) -> list:
    """Request i drafts from the answers of requests 0..i-1 (the store a real run appends to),
    optionally after the instruction store. Totals over requests ``warmup`` and later."""
    lines = []
    later = queries[warmup:]
    baseline = totals([replay(PromptLookupSource(), p, a, max_tokens) for p, a in later])
    lines.append(
        row(f"{workload} {warmup + 1}-{len(queries)}", "prompt lookup", 0, baseline, baseline)
    )
    for seeded in (False, True):
        seed = list(join_outputs(store)) if seeded else []
        for name, options in variants.items():
            runs = []
            for i, (prompt, answer) in enumerate(queries[warmup:], start=warmup):
                context = seed + list(join_outputs([a for _, a in queries[:i]]))
                runs.append(replay(with_history(context, **options), prompt, answer, max_tokens))
            label = f"{name}, earlier answers" + (" + instruction store" if seeded else "")
            lines.append(
                row(
                    f"{workload} {warmup + 1}-{len(queries)}",
                    label,
                    "grows",
                    totals(runs),
                    baseline,
                )
            )
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--store-prompts", type=int, default=208, help="Instructions answered for the store."
    )
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[10_000, 20_000, 30_000],
        help="Store sizes in tokens (the full store is always added).",
    )
    args = parser.parse_args()
    from loading.load import load_model

    model, tokenizer, _ = load_model()
    store = store_answers(model, tokenizer, args.store_prompts)
    chat = query_set(model, tokenizer, "chat", 128)
    repeated = {
        "replies": (query_set(model, tokenizer, "replies", 96), 96),
        "extraction": (query_set(model, tokenizer, "extraction", 64), 64),
    }
    full = sum(len(a) + 1 for a in store)
    sizes = sorted({s for s in args.sizes if s < full} | {full})
    variants = {"+ history": {}, "+ history, n-grams up to 8": {"ngram_max": 8}}

    header = [
        "| workload | source | store tokens | tokens | target passes | passes saved vs plain | "
        "vs prompt lookup | modelled speed-up | search ms (median) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines = header + chat_study(chat, store, sizes, 128, variants)
    for workload, (queries, max_tokens) in repeated.items():
        lines += repeated_study(workload, queries, store, max_tokens, variants)
    table = "\n".join(lines)
    print(table)
    sizes = " ".join(map(str, args.sizes))
    command = (
        f"python -m benchmarks.history_replay --store-prompts {args.store_prompts} --sizes {sizes}"
    )
    RESULTS.write_text(
        "Replay (no model runs; exact greedy pass counts, which tests/test_history_lookup.py "
        f"checks against the loop): `{command}`. Store: answers to {len(store)} self-written "
        f"instructions ({full} tokens). Answers at most 128 tokens (chat), 96 (replies), 64 "
        "(extraction); requests 1-3 of a workload are left out.\n\n"
        f"{table}\n"
    )


if __name__ == "__main__":
    main()
