"""The measured verification cost against the constants it replaced, side by side (issue #25).

    flock /tmp/bench.lock python -m benchmarks.pass_cost

Each adaptive method runs twice per prompt, interleaved: once with ``decoder.PassCost`` on a clock
that stands still, so every choice reads the prior (a verified token costs 0.09 of a step, and
a model's drafting its weight-byte ratio: what the constants said before), and once measuring
its own passes as ``main.py`` does. Prompts: the grounded classes of benchmarks/prompts (prompt
lookup) and held-out chat (the shipped head). Greedy outputs must match plain decoding. It
prints, and writes to benchmarks/results/pass_cost.md, the table and what each run measured.
"""

import argparse
import statistics
from pathlib import Path

from benchmarks.harness import (
    Method,
    first_prompts,
    heldout_prompts,
    load_prompts,
    markdown_table,
    side_by_side,
    time_loop,
)
from decoder.pass_cost import PassCost
from decoder.text import eos_ids_of
from draft_head.source import HeadDrafter
from prompt_lookup import PromptLookupSource

RESULTS = Path(__file__).parent / "results" / "pass_cost.md"


def frozen() -> PassCost:
    return PassCost(clock=lambda: 0.0)  # nothing is ever timed: the priors throughout


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2, help="prompts per task class")
    parser.add_argument("--max-tokens", type=int, default=96)
    return parser.parse_args()


def main():
    args = parse_args()

    from loading.load import load_model

    model, tokenizer, _ = load_model()
    eos = eos_ids_of(tokenizer)
    measured = {"prompt lookup": [], "draft head": [], "head drafting": []}

    def lookup(cost_of):
        def make(prompt):
            cost = cost_of()
            if cost.clock is not frozen_clock:
                measured["prompt lookup"].append(cost)
            return {"draft_sources": [PromptLookupSource()], "pass_cost": cost}

        return make

    tap, drafter = HeadDrafter.create(model)
    head = drafter.source()

    def with_head(cost_of):
        def run(prompt, max_tokens):
            cost = cost_of()
            result = time_loop(tap, prompt, max_tokens, eos, draft_sources=[head], pass_cost=cost)
            if cost.clock is not frozen_clock:
                measured["draft head"].append(cost)
            return result

        return run

    frozen_clock = frozen().clock
    prior = lambda: PassCost(clock=frozen_clock)  # noqa: E731
    grounded = first_prompts(
        load_prompts(tokenizer, ["code_edit", "extractive_qa", "summarize_quotes"]), args.prompts
    )
    results = side_by_side(
        model,
        tokenizer,
        grounded,
        [
            Method("plain"),
            Method("prompt lookup, prior 0.09", lookup(prior)),
            Method("prompt lookup, measured", lookup(PassCost)),
        ],
        args.max_tokens,
    )
    chat = {"held-out chat": heldout_prompts(tokenizer)[: 2 * args.prompts]}
    results.update(
        side_by_side(
            model,
            tokenizer,
            chat,
            [
                Method("plain"),
                Method("draft head, prior", run=with_head(prior)),
                Method("draft head, measured", run=with_head(PassCost)),
            ],
            args.max_tokens,
        )
    )

    text = report(args, results, measured["prompt lookup"], measured["draft head"], head)
    print(text)
    RESULTS.write_text(text)


def median(costs, read):
    """The median of ``read(cost)`` over the runs that timed a pass (NaN when none did)."""
    values = [read(cost) for cost in costs if cost.seconds() is not None]
    return statistics.median(values) if values else float("nan")


def report(args, results, lookup_costs, head_costs, head) -> str:
    """The results page: the side-by-side table and what the measured runs fitted."""
    lines = [
        "# The measured verification cost (issue #25)",
        "",
        f"`python -m benchmarks.pass_cost --prompts {args.prompts} --max-tokens "
        f"{args.max_tokens}`: embedded SmolLM2-135M-Instruct, float32, this 2-core x86 CPU, "
        "greedy, methods interleaved per "
        'prompt in one process. "prior" runs never time anything, so they decide as the old '
        'constants did; "measured" runs time their own passes (decoder.PassCost), as main.py and '
        "the server do.",
        "",
        markdown_table(results, "plain"),
        "",
        "What the measured runs fitted (median over runs):",
        "",
        "| quantity | constant before | measured here |",
        "|---|---:|---:|",
        f"| one more verified token, fraction of a step (prompt lookup runs) | 0.09 | "
        f"{median(lookup_costs, lambda c: c.token_cost()):.3f} |",
        f"| one more verified token, fraction of a step (head runs) | 0.09 | "
        f"{median(head_costs, lambda c: c.token_cost()):.3f} |",
        f"| one-token pass, ms | - | {1000 * median(lookup_costs, lambda c: c.seconds()):.1f} |",
        f"| the head drafting one token, fraction of a step | {head.draft_cost_prior:.3f} (weight "
        "bytes; 0.15 - 0.09 before) | "
        f"{median(head_costs, lambda c: c.draft_cost('draft_head', float('nan'))):.3f} |",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
