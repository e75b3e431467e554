"""The prompt cache on disk (prompt_store/): what a restore saves over a cold prefill, at each block
size, and what storing costs.

    flock /tmp/bench.lock python -m benchmarks.prompt_store [--lengths 1024 2048]
        [--blocks 64 128 256 512]

The embedded SmolLM2-135M (float32), one row. The document is the repo's own docs (README.md and
docs/*.md, raw tokens) cut to each length, then a question. Per block size, in a fresh folder:
- **store**: the first run, which prefills and stores the blocks (the prefill stops at block
  boundaries only where the model needs it: not for this full-attention model);
- **restart**: a new ``PromptStore`` on the folder (as after a restart) and the same prompt;
- **follow-up**: the same document with another question, as a conversation's next turn.
Time to the first token is the prompt's time (prefill or restore, and the rest's prefill);
``close`` waits for the writer thread. A cold prefill without a store runs first and last.
"""

import argparse
import platform
import shutil
import tempfile
import time
from pathlib import Path

from loading import fast_blas

fast_blas.load()

import mlx.core as mx  # noqa: E402

from decoder import generate_step  # noqa: E402
from decoder.row import DecodingStats  # noqa: E402
from loading.load import describe_backend, load_model  # noqa: E402
from prompt_store import PromptStore  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "prompt_store.md"
QUESTIONS = ["\nQuestion: what is this project for?\nAnswer:", "\nQuestion: how is it tested?\n"]


def first_token(model, prompt: list, store=None) -> tuple:
    """(seconds to the first token, prompt tokens restored)."""
    stats = DecodingStats()
    started = time.perf_counter()
    next(
        generate_step(
            prompt, model, eos_token_ids=(), max_tokens=1, prompt_store=store, stats=stats
        )
    )
    return time.perf_counter() - started, stats.prompt_cache_tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--blocks", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    model, tokenizer, _ = load_model(None)
    text = "\n".join(
        p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    )
    words = tokenizer.encode(text)
    questions = [tokenizer.encode(q) for q in QUESTIONS]
    first_token(model, words[:64])  # warm up
    lines = [
        "# Prompt cache on disk (#57)",
        "",
        f"`flock /tmp/bench.lock python -m benchmarks.prompt_store --lengths "
        f"{' '.join(map(str, args.lengths))} --blocks {' '.join(map(str, args.blocks))}`",
        "",
        f"{describe_backend()}, {platform.machine()}; embedded SmolLM2-135M-Instruct (float32), "
        "one row; time to the first token in seconds (the prompt's prefill, or its restore and "
        "the rest's prefill). The folder is on this machine's disk and the blocks are in its page "
        "cache when read back, as after a restart of a server on the same machine.",
        "",
        "| document | block | cold | store | close | restart | restored | follow-up | restored "
        "| files | MB on disk |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for length in args.lengths:
        prompts = [words[:length] + question for question in questions]
        colds = [first_token(model, prompts[0])[0]]
        for block in args.blocks:
            folder = Path(tempfile.mkdtemp(prefix="prompt-store-"))
            try:
                store = PromptStore(folder, model, block_tokens=block)
                stored, _ = first_token(model, prompts[0], store)
                tic = time.perf_counter()
                store.close()
                closing = time.perf_counter() - tic
                store = PromptStore(folder, model, block_tokens=block)
                restart, restored = first_token(model, prompts[0], store)
                follow, followed = first_token(model, prompts[1], store)
                store.close()
                files = list((folder / "blocks").rglob("*.safetensors"))
                size = sum(f.stat().st_size for f in files) / 1e6
            finally:
                shutil.rmtree(folder)
            colds.append(first_token(model, prompts[0])[0])
            lines.append(
                f"| {len(prompts[0])} | {block} | {colds[-2]:.2f} | {stored:.2f} | {closing:.2f} | "
                f"{restart:.2f} | {restored} | {follow:.2f} | {followed} | {len(files)} | "
                f"{size:.0f} |"
            )
            print(lines[-1], flush=True)
    lines += [
        "",
        "**cold**: no store, measured before each block size's runs. **store**: the first run "
        "with the store (its prefill and queueing the blocks); **close**: waiting for the writer. "
        "**restart**: a new store on the folder, the same prompt; **follow-up**: another question "
        "after the same document. **restored**: prompt tokens read from disk.",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"peak {mx.get_peak_memory() / 1e9:.2f} GB; wrote {args.out}")


if __name__ == "__main__":
    main()
