"""History lookup in real decoding: plain vs prompt lookup vs prompt lookup + history, side by side.

    flock /tmp/bench.lock python -m benchmarks.history_lookup

- Held-out chat (benchmarks/heldout/chat.txt): each prompt gets a fresh store, the seeded
  one (answers to the head's self-written instructions, benchmarks/history_data.py) plus
  what the run itself writes, so no prompt drafts from an earlier run of itself.
- Repeated order-confirmation replies (benchmarks/history_tasks.py): 20 requests in order, the
  store holding the answers of the requests before (as ``main.py --lookup-history`` appends them).

Methods are interleaved per prompt in one process (benchmarks/harness.py); greedy outputs
must match plain decoding token for token, or the harness says so.
"""

import argparse
import sys
from pathlib import Path

import fast_blas

fast_blas.load()

from benchmarks.harness import Method, chat_tokens, markdown_table, side_by_side, time_loop  # noqa: E402
from benchmarks.history_data import HELDOUT, store_answers  # noqa: E402
from benchmarks.history_tasks import requests  # noqa: E402
from decoder import eos_ids_of  # noqa: E402
from prompt_lookup import PromptLookupSource  # noqa: E402
from prompt_lookup.history import HistoryLookupSource, join_outputs  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "history.md"


def remembering(model, source, eos) -> Method:
    """A method whose one source outlives the runs and remembers each output, as the store does."""

    def run(prompt, max_tokens):
        result = time_loop(model, prompt, max_tokens, eos, draft_sources=[source])
        source.remember(result.tokens)
        return result

    return Method("prompt lookup + history", run=run)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store-prompts", type=int, default=208, help="Instructions answered for the seeded store.")
    parser.add_argument("--chat-tokens", type=int, default=128, help="Most tokens per chat answer.")
    parser.add_argument("--reply-tokens", type=int, default=96, help="Most tokens per reply.")
    parser.add_argument("--prompts", type=int, default=None, help="Use only the first N prompts of each workload.")
    parser.add_argument("--warmup-requests", type=int, default=3, help="Extraction requests reported apart.")
    args = parser.parse_args()
    from loading import load_model

    model, tokenizer, _ = load_model()
    eos = eos_ids_of(tokenizer)
    seeded = join_outputs(store_answers(model, tokenizer, args.store_prompts))
    lookup = Method("prompt lookup", lambda prompt: {"draft_sources": [PromptLookupSource()]})

    lines = [line for line in HELDOUT.read_text().splitlines() if line.strip()][: args.prompts]
    chat = {"held-out chat": [(f"chat{i}", chat_tokens(tokenizer, line)) for i, line in enumerate(lines)]}
    chat_methods = [Method("plain"), lookup, Method("prompt lookup + history (seeded store)", lambda prompt: {
        "draft_sources": [HistoryLookupSource(seeded)]})]
    results = side_by_side(model, tokenizer, chat, chat_methods, args.chat_tokens)

    texts = requests("replies")[: args.prompts]
    replies = [(f"reply{i}", chat_tokens(tokenizer, text)) for i, text in enumerate(texts)]
    first = args.warmup_requests
    workload = {f"replies 1-{first}": replies[:first], f"replies {first + 1}-{len(replies)}": replies[first:]}
    # No warm-up run here: it would put the first request's answer in the store (the process is warm).
    reply_methods = [Method("plain"), lookup, remembering(model, HistoryLookupSource(), eos)]
    results.update(side_by_side(model, tokenizer, workload, reply_methods, args.reply_tokens, warmup=False))

    table = markdown_table(results, "plain")
    print(table)
    RESULTS.parent.mkdir(exist_ok=True)
    command = " ".join(["python -m benchmarks.history_lookup", *sys.argv[1:]])
    with open(RESULTS, "a") as file:  # after the replay's table (benchmarks/history_replay.py writes the file)
        file.write(f"\nReal decoding, timed, methods interleaved per prompt in one process: `{command}`. "
                   f"Chat: {args.chat_tokens} tokens max, a fresh seeded store per prompt; replies: "
                   f"{args.reply_tokens} tokens max, the store holding the earlier replies.\n\n{table}\n")


if __name__ == "__main__":
    main()
