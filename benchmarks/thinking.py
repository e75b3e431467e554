"""Thinking budgets: tokens in the think block, whether an answer follows, passes per token and
speed.

    python -m benchmarks.thinking [--max-tokens 256] [--budgets 16 64] [--repeats 3]

Qwen3's tokenizer and template (tests/data/qwen3-small) with the template variant that opens the
block (Qwen3.5-style), on a random model of that vocabulary (hidden 256, 4 layers: no weights to
download; it never closes the block itself, the worst case a budget is for). Each row decodes the
same prompt greedily: no budget, budgets, and a budget with a JSON schema after the block; and, for
the wrapper's own cost, the unbounded block through ``ThinkingConstraint`` (no budget, no schema)
against no constraint.
"""

import argparse
import json
import time

import mlx.core as mx

from constrained.build import regex_constraint
from constrained.json_schema import schema_to_regex
from constrained.think_markers import think_markers
from constrained.thinking import ThinkingConstraint, ThinkingForcedSource, split_reasoning
from decoder import generate
from tests.helpers import qwen3_small_tokenizer, tiny_llama

SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}


def row(
    name,
    model,
    tokenizer,
    prompt,
    markers,
    phase,
    max_tokens,
    repeats,
    budget=None,
    schema=False,
    wrap=True,
):
    """Decode ``repeats`` times; the best time, and the last run's counts."""
    best = float("inf")
    for _ in range(repeats):
        inner, forced = (
            regex_constraint(schema_to_regex(SCHEMA), tokenizer, len(tokenizer))
            if schema
            else (None, None)
        )
        constraint = (
            ThinkingConstraint(markers, len(tokenizer), inner, budget, phase) if wrap else None
        )
        sources = [ThinkingForcedSource(constraint, forced)] if wrap else []
        tic = time.perf_counter()
        result = generate(
            model,
            tokenizer,
            prompt,
            constraint=constraint,
            draft_sources=sources,
            max_tokens=max_tokens,
        )
        best = min(best, time.perf_counter() - tic)
    reasoning, answer = split_reasoning(result.text, markers, phase)
    inside = (
        len(result.tokens)
        if markers.end_tokens[0] not in result.tokens
        else result.tokens.index(markers.end_tokens[0])
    )
    valid = ""
    if schema:
        try:
            valid = (
                "valid"
                if json.loads(answer)["city"] in SCHEMA["properties"]["city"]["enum"]
                else "invalid"
            )
        except (ValueError, KeyError, TypeError):
            valid = "invalid"
    return (
        f"| {name} | {inside} | {'yes' if answer.strip() else 'no'} {valid} | {len(result.tokens)} "
        f"| {result.stats.target_forward_passes / len(result.tokens):.3f} | "
        f"{len(result.tokens) / best:.1f} |"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--budgets", type=int, nargs="*", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokenizer = qwen3_small_tokenizer(opens=True)
    model = tiny_llama(vocab_size=len(tokenizer), num_layers=4, hidden_size=256, seed=5, sharp=2.0)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a city."}], add_generation_prompt=True
    )
    markers = think_markers(tokenizer)
    phase = markers.phase(prompt, tokenizer.decode)
    common = (model, tokenizer, prompt, markers, phase, args.max_tokens, args.repeats)
    print(
        f"| request (max_tokens {args.max_tokens}) | tokens in the block | answer | tokens | "
        "passes/token | tok/s |"
    )
    print("|---|---:|---|---:|---:|---:|")
    print(row("no constraint", *common, wrap=False), flush=True)
    print(row("wrapper, no budget", *common), flush=True)
    for budget in args.budgets:
        print(row(f"budget {budget}", *common, budget=budget), flush=True)
        print(
            row(f"budget {budget} + JSON schema", *common, budget=budget, schema=True), flush=True
        )
    mx.clear_cache()


if __name__ == "__main__":
    main()
