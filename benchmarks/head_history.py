"""The shipped draft head and history lookup, alone and choosing per step, side by side (issue #20).

    flock /tmp/bench.lock python -m benchmarks.head_history

- Held-out chat (benchmarks/heldout/chat.txt), greedy and at temperature 1. Each prompt gets a
  fresh store holding only the seed that ships with the head
  (draft_head/heads/smollm2-135m/history.npz), as ``main.py --draft-head --lookup-history
  FRESH_PATH`` would: what history adds comes from the seed and the answer itself.
- Repeated requests (benchmarks/history_tasks.py: 20 order-confirmation replies, 20 field
  extractions), greedy, in order; the store holds the answers to the requests before, as
  ``--lookup-history`` appends them (and the seed, where the head is used). The first
  ``--warmup-requests`` are reported apart.

"+ head" methods put the copier first and the head second: per step the loop lets the head draft
only when it forecasts a larger speed-up than the copy's draft (draft.choose_draft). Methods are
interleaved per prompt in one process (benchmarks/harness.py); greedy outputs must match plain
decoding token for token, or the harness says so.
"""

import argparse
import sys
from pathlib import Path

from benchmarks.harness import (
    Method,
    chat_tokens,
    heldout_prompts,
    markdown_table,
    side_by_side,
    time_loop,
)
from benchmarks.history_tasks import requests
from decoder.sampling import Sampling
from decoder.text import eos_ids_of
from draft_head.head import SHIPPED_HEAD
from draft_head.source import HeadDrafter
from loading import fast_blas
from prompt_lookup import PromptLookupSource
from prompt_lookup.history import HistoryLookupSource, load_history

RESULTS = Path(__file__).parent / "results" / "head_history.md"


def method(name, model, make_sources, eos, temp=0.0, remember=None) -> Method:
    """Runs the loop on ``model`` (the head's tap where a head drafts) with fresh copiers per
    prompt; ``remember`` is a store source that outlives the prompts and keeps each answer."""

    def run(prompt, max_tokens):
        result = time_loop(
            model, prompt, max_tokens, eos, draft_sources=make_sources(), sampling=Sampling(temp)
        )
        if remember is not None:
            remember.remember(result.tokens)
        return result

    return Method(name, run=run, greedy=temp == 0)


def chat_methods(model, tap, head, seed, eos, temp):
    return [
        method("plain", model, lambda: [], eos, temp),
        method("draft head", tap, lambda: [head], eos, temp),
        method("prompt lookup + head", tap, lambda: [PromptLookupSource(), head], eos, temp),
        method("history (seed) + head", tap, lambda: [HistoryLookupSource(seed), head], eos, temp),
        method("history (seed)", model, lambda: [HistoryLookupSource(seed)], eos, temp),
    ]


def repeated_methods(model, tap, head, seed, eos):
    """Stores that grow with the answers, one per method that uses one."""
    alone, with_head = HistoryLookupSource(), HistoryLookupSource(seed)
    return [
        method("plain", model, lambda: [], eos),
        method("prompt lookup", model, lambda: [PromptLookupSource()], eos),
        method("prompt lookup + head", tap, lambda: [PromptLookupSource(), head], eos),
        method("history", model, lambda: [alone], eos, remember=alone),
        method("history (seed) + head", tap, lambda: [with_head, head], eos, remember=with_head),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--chat-prompts", type=int, default=16, help="Held-out chat prompts at temperature 0."
    )
    parser.add_argument(
        "--sampled-prompts", type=int, default=8, help="Held-out chat prompts at temperature 1."
    )
    parser.add_argument("--max-tokens", type=int, default=96, help="Most tokens per answer.")
    parser.add_argument("--requests", type=int, default=20, help="Requests per repeated workload.")
    parser.add_argument(
        "--warmup-requests", type=int, default=3, help="First requests, reported apart."
    )
    args = parser.parse_args()
    from loading.load import load_model

    model, tokenizer, _ = load_model()
    eos = eos_ids_of(tokenizer)
    seed = load_history(SHIPPED_HEAD / "history.npz")
    (tap, drafter), (sampled_tap, sampled_drafter) = (HeadDrafter.create(model) for _ in range(2))
    head, sampled_head = drafter.source(), sampled_drafter.source()

    chat = heldout_prompts(tokenizer)
    results = side_by_side(
        model,
        tokenizer,
        {"held-out chat, temp 0": chat[: args.chat_prompts]},
        chat_methods(model, tap, head, seed, eos, 0.0),
        args.max_tokens,
    )
    results.update(
        side_by_side(
            model,
            tokenizer,
            {"held-out chat, temp 1": chat[: args.sampled_prompts]},
            chat_methods(model, sampled_tap, sampled_head, seed, eos, 1.0),
            args.max_tokens,
        )
    )
    first = args.warmup_requests
    for workload in ("replies", "extraction"):
        items = [
            (f"{workload}{i}", chat_tokens(tokenizer, text))
            for i, text in enumerate(requests(workload, args.requests))
        ]
        classes = {
            f"{workload} 1-{first}": items[:first],
            f"{workload} {first + 1}-{len(items)}": items[first:],
        }
        # No warm-up run: it would put the first request's answer in the stores (the process is
        # warm).
        results.update(
            side_by_side(
                model,
                tokenizer,
                classes,
                repeated_methods(model, tap, head, seed, eos),
                args.max_tokens,
                warmup=False,
            )
        )

    table = markdown_table(results, "plain")
    print(table)
    command = " ".join(["python -m benchmarks.head_history", *sys.argv[1:]])
    RESULTS.write_text(
        f"# Draft head + history lookup, choosing per step\n\n`{command}` · "
        f"{fast_blas.describe()} · max {args.max_tokens} new tokens\n\n{table}\n"
    )


if __name__ == "__main__":
    main()
