"""Benchmarks: python -m benchmarks.run --suite {plain,prompt_lookup,regex,speculative}

Each suite prints a Markdown table (and saves it under benchmarks/results/).
On Linux run it with OpenBLAS preloaded (`make bench` does).
"""

import argparse
import datetime
import platform
from pathlib import Path

import mlx.core as mx

from benchmarks.harness import Method, load_prompts, markdown_table, side_by_side
from loading import default_dtype, describe_backend, load_model

RESULTS = Path(__file__).parent / "results"


def mlx_lm_runner(model, tokenizer):
    from mlx_lm import stream_generate

    def run(prompt, max_tokens):
        for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
            yield response.token
            if response.finish_reason is not None:
                return

    return run


def plain_suite(model, tokenizer, args):
    """Plain decoding through our loop vs mlx-lm's own generate, same prompts."""
    prompts = load_prompts(tokenizer, ["open_ended", "extractive_qa"])
    methods = [Method("plain"), Method("mlx-lm generate", run=mlx_lm_runner(model, tokenizer))]
    return side_by_side(model, tokenizer, prompts, methods, args.max_tokens), "plain"


def prompt_lookup_suite(model, tokenizer, args):
    from prompt_lookup import PromptLookupSource

    prompts = load_prompts(tokenizer)
    methods = [Method("plain"),
               Method("prompt lookup", lambda prompt: {"draft_sources": [PromptLookupSource()]})]
    if args.num_draft_sweep:
        for k in args.num_draft_sweep:
            methods.append(Method(f"prompt lookup k={k} fixed", lambda prompt, k=k: {
                "draft_sources": [PromptLookupSource(num_draft=k, adaptive=False)]}))
    return side_by_side(model, tokenizer, prompts, methods, args.max_tokens), "plain"


SUITES = {"plain": plain_suite, "prompt_lookup": prompt_lookup_suite}


def main():
    parser = argparse.ArgumentParser(description="Side-by-side decoding benchmarks.")
    parser.add_argument("--suite", choices=sorted(SUITES) + ["all"], default="plain")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--num-draft-sweep", type=int, nargs="*", default=None,
                        help="Also run fixed draft lengths (prompt lookup suite).")
    args = parser.parse_args()

    model, tokenizer, path = load_model()
    header = (f"{datetime.date.today()} · {platform.node() or 'this machine'} · {describe_backend()} · "
              f"SmolLM2-135M-Instruct {default_dtype()} · greedy · max {args.max_tokens} new tokens · "
              f"mlx {mx.__version__}")
    print(header)
    RESULTS.mkdir(exist_ok=True)
    for name in sorted(SUITES) if args.suite == "all" else [args.suite]:
        print(f"\n## {name}")
        results, baseline = SUITES[name](model, tokenizer, args)
        table = markdown_table(results, baseline)
        print(table)
        (RESULTS / f"{name}.md").write_text(f"{header}\n\n{table}\n")


if __name__ == "__main__":
    main()
