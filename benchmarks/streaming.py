"""Is streaming detokenization's cost per token flat in the output length?

    python -m benchmarks.streaming

Feeds a fixed token stream (the first 100 tokens of the benchmark prompts,
repeated, so every length has the same mix of tokens; no model) through ``decoder.TextStream`` and through the old scheme that decoded the whole
output for every token, and prints the time per token of the 100 tokens that end
at 100, 500, ..., 4,000 generated tokens. Both run on the same tokens in one process.
"""

import datetime
import platform
import time
from pathlib import Path

from decoder import TextStream
from loading import load_model

LENGTHS = (100, 500, 1000, 2000, 4000)
BLOCK = 100
RESULTS = Path(__file__).parent / "results"


def full_redecode(tokenizer):
    """The scheme TextStream replaced: decode everything so far for every token (quadratic)."""
    generated = []

    def add(token):
        generated.append(token)
        return tokenizer.decode(generated)

    return add


def block_times_us(make_add, tokenizer, tokens, repeats):
    """Per-token time of each 100-token block, the best of ``repeats`` passes over all tokens.

    Timing blocks inside one long pass, rather than whole passes of each length,
    compares positions under the same conditions (a noisy, shared machine).
    """
    best = [float("inf")] * (len(tokens) // BLOCK)
    for _ in range(repeats):
        add = make_add(tokenizer)
        for block in range(len(best)):
            tic = time.perf_counter()
            for token in tokens[block * BLOCK : (block + 1) * BLOCK]:
                add(token)
            best[block] = min(best[block], (time.perf_counter() - tic) / BLOCK * 1e6)
    return best


def main():
    _, tokenizer, _ = load_model()
    text = "\n\n".join(p.read_text() for p in sorted((Path(__file__).parent / "prompts").glob("*/*.txt")))
    tokens = tokenizer.encode(text, add_special_tokens=False)[: LENGTHS[0]] * (max(LENGTHS) // LENGTHS[0])
    text_stream = block_times_us(lambda tokenizer: TextStream(tokenizer).add, tokenizer, tokens, repeats=5)
    redecode = block_times_us(full_redecode, tokenizer, tokens, repeats=2)
    rows = ["| generated tokens | TextStream µs/token | full re-decode µs/token |", "|---:|---:|---:|"]
    for length in LENGTHS:
        block = length // BLOCK - 1  # the block that ends at this length
        rows.append(f"| {length} | {text_stream[block]:.1f} | {redecode[block]:.1f} |")
    header = (f"`python -m benchmarks.streaming` · {datetime.date.today()} · {platform.machine()} CPU · "
              "SmolLM2-135M-Instruct tokenizer, no model · the first 100 tokens of benchmarks/prompts, "
              "repeated · µs per token over the 100 tokens that end at each length, best of 5 passes (2 for "
              "the full re-decode)")
    table = "\n".join(rows)
    print(f"\n{header}\n\n{table}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "streaming.md").write_text(f"# Streaming detokenization\n\n{header}\n\n{table}\n")


if __name__ == "__main__":
    main()
