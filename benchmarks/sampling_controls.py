"""Sampling controls (issue #50): prompt lookup under a repetition penalty, and what the logits
processors and truncations cost per step.

    flock /tmp/mlxdec-test.lock python -m benchmarks.sampling_controls

Greedy decoding of the embedded model on the code_edit and extractive_qa prompts, plain and with
prompt lookup, each with and without the logits processors (repetition penalty 1.1 over 20 tokens,
and presence 0.5 with frequency 0.3), in interleaved rounds. Every output must equal plain
decoding with the same processors. Then the processors' and the truncations' own cost, timed
alone (evaluated per call, an upper bound of what they add to the loop's lazy graph), against one
decoding step. Writes benchmarks/results/sampling_controls.md.
"""

import argparse
import statistics
from pathlib import Path

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors as mlx_lm_processors

from benchmarks.harness import first_prompts, load_prompts, median_ms, time_loop
from decoder.processors import make_logits_processors, process_logits
from decoder.sampling import Sampling
from decoder.text import eos_ids_of
from prompt_lookup import PromptLookupSource

RESULTS = Path(__file__).parent / "results" / "sampling_controls.md"
PROCESSORS = {
    "none": {},
    "repetition 1.1": dict(repetition_penalty=1.1),
    "presence 0.5 + frequency 0.3": dict(presence_penalty=0.5, frequency_penalty=0.3),
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=1, help="prompts per task class")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    return parser.parse_args()


def loop_table(model, tokenizer, args) -> list:
    """Rows of (processors, source, tokens, passes per token, tok/s) summed over prompts and
    rounds; checks each lookup output against plain decoding with the same processors."""
    eos = eos_ids_of(tokenizer)
    prompts = [
        tokens
        for items in first_prompts(
            load_prompts(tokenizer, ["code_edit", "extractive_qa"]), args.prompts
        ).values()
        for _, tokens in items
    ]
    totals = {}
    for _ in range(args.rounds):
        for prompt in prompts:
            plain_tokens = {}
            for name, settings in PROCESSORS.items():
                for source in ("plain", "prompt lookup"):
                    run = time_loop(
                        model,
                        prompt,
                        args.max_tokens,
                        eos,
                        logits_processors=make_logits_processors(**settings),
                        draft_sources=[PromptLookupSource()] if source != "plain" else [],
                    )
                    if source == "plain":
                        plain_tokens[name] = run.tokens
                    elif run.tokens != plain_tokens[name]:
                        raise SystemExit(f"lookup under {name} differs from plain decoding")
                    total = totals.setdefault((name, source), [0, 0, 0.0])
                    total[0] += len(run.tokens)
                    total[1] += run.forward_passes
                    total[2] += run.decode_time
    return [
        (name, source, tokens, passes / tokens, tokens / seconds)
        for (name, source), (tokens, passes, seconds) in totals.items()
    ]


def pass_ms(model, width: int) -> float:
    """Median ms of one verify pass of ``width`` tokens over a cache of 64."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.zeros((1, 64), mx.int32), cache=cache)
    inputs = mx.ones((1, width), mx.int32)

    def one_pass():
        mx.eval(model(inputs, cache=cache))
        for layer in cache:
            layer.trim(width)

    return median_ms(one_pass, 15)[0]


def cost_table(model, vocab_size: int) -> list:
    """Rows of (what, width, ms per call, share of a pass of that width)."""
    context = list(range(100, 612))  # 512 tokens before the pass
    rows, passes = [], {}
    for width in (1, 4, 8):
        passes[width] = pass_ms(model, width)
        logits = mx.random.normal((width, vocab_size))
        draft = list(range(width - 1))
        mx.eval(logits)
        settings = dict(
            logit_bias={5: 1.0}, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3
        )
        processors, looped = make_logits_processors(**settings), mlx_lm_processors(**settings)
        calls = {
            "logit_bias + 3 penalties": lambda: mx.eval(
                process_logits(processors, context, draft, logits)
            ),
            "the same, mlx-lm's (a call per position)": lambda: mx.eval(
                process_logits(looped, context, draft, logits)
            ),
            "temperature only": lambda: mx.eval(Sampling(0.8).probs(logits)),
            "top_k 40 + min_p 0.05": lambda: mx.eval(
                Sampling(0.8, top_k=40, min_p=0.05).probs(logits)
            ),
            "XTC 0.5 (both branches)": lambda: mx.eval(
                Sampling(0.8, xtc_probability=0.5).probs(logits)
            ),
        }
        for what, call in calls.items():
            call()  # compile, warm up
            ms = statistics.median(median_ms(call, 15)[0] for _ in range(3))
            rows.append((what, width, ms, ms / passes[width]))
    return rows, passes


def main():
    args = parse_args()
    from loading.load import load_model

    model, tokenizer, _ = load_model(None)
    loops = loop_table(model, tokenizer, args)
    costs, passes = cost_table(model, model.args.vocab_size)
    dtype = str(model.model.embed_tokens.weight.dtype).removeprefix("mlx.core.")
    lines = [
        "# Sampling controls (issue #50)",
        "",
        "Command: `flock /tmp/mlxdec-test.lock .venv/bin/python -m benchmarks.sampling_controls "
        f"--prompts {args.prompts} --max-tokens {args.max_tokens} --rounds {args.rounds}`",
        "",
        f"Embedded SmolLM2-135M-Instruct ({dtype}), greedy, a 2-core Linux CPU (shared).",
        "",
        "## Prompt lookup under penalties",
        "",
        "code_edit and extractive_qa prompts, summed over prompts and rounds (interleaved); every "
        "lookup output equals plain decoding with the same processors.",
        "",
        "| processors | source | tokens | passes/token | tok/s |",
        "|---|---|---:|---:|---:|",
        *(f"| {n} | {s} | {t} | {p:.3f} | {r:.1f} |" for n, s, t, p, r in loops),
        "",
        "## Cost per call",
        "",
        "A verify pass over 64 cached tokens: "
        + ", ".join(f"{ms:.1f} ms at width {w}" for w, ms in passes.items())
        + ". Each call evaluated alone (an upper bound: in the loop it joins the pass's lazy "
        "graph); processors with 512 tokens of context, ours (decoder.make_logits_processors: "
        "every position of the pass at once, equal to mlx-lm's) and mlx-lm's own called once "
        "per position. Temperature only is what sampling cost before these controls.",
        "",
        "| what | width | ms | share of the pass |",
        "|---|---:|---:|---:|",
        *(f"| {w} | {width} | {ms:.3f} | {share:.1%} |" for w, width, ms, share in costs),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
