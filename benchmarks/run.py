"""Benchmarks: python -m benchmarks.run --suite
{plain,prompt_lookup,regex,speculative,draft_head,...}

Each suite prints a Markdown table and saves it as benchmarks/results/<suite>.md
(<suite>.latest.md beside a hand-written one). The fast BLAS loads in benchmarks/__init__.py.
"""

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.draft_head import draft_head_cost_suite, draft_head_misses_suite, draft_head_suite
from benchmarks.harness import (
    Method,
    Run,
    Totals,
    first_prompts,
    load_prompts,
    markdown_table,
    mlx_lm_speculative_runner,
    self_draft_path,
    side_by_side,
)
from loading.load import default_dtype, describe_backend, load_model

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
    methods = [
        Method("plain"),
        Method("prompt lookup", lambda prompt: {"draft_sources": [PromptLookupSource()]}),
    ]
    for k in args.num_draft_sweep or []:
        methods.append(
            Method(
                f"prompt lookup k={k} fixed",
                lambda prompt, k=k: {
                    "draft_sources": [PromptLookupSource(num_draft=k, adaptive=False)]
                },
            )
        )
    results = side_by_side(model, tokenizer, prompts, methods, args.max_tokens)
    grounded = [task for task in results if task != "open_ended"]
    results["grounded, all"] = {
        m.name: Totals([run for task in grounded for run in results[task][m.name].runs])
        for m in methods
    }
    return results, "plain"


def transformers_suite(model, tokenizer, args):
    """Hugging Face transformers (PyTorch CPU) on the same weights: plain vs its prompt lookup."""
    import torch
    from transformers import AutoModelForCausalLM

    from loading.load import default_model_path
    from prompt_lookup import PromptLookupSource

    torch.set_num_threads(2)
    hf_model = AutoModelForCausalLM.from_pretrained(
        default_model_path("float32"), dtype=torch.float32
    ).eval()
    eos = sorted(tokenizer.eos_token_ids)

    def runner(**options):
        def run(prompt, max_tokens):
            inputs = torch.tensor([prompt])
            # Time the prefill alone to report decode speed like the MLX runs.
            tic = time.perf_counter()
            with torch.no_grad():
                hf_model(inputs)
            prefill = time.perf_counter() - tic
            tic = time.perf_counter()
            with torch.no_grad():
                out = hf_model.generate(
                    inputs,
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    eos_token_id=eos,
                    pad_token_id=eos[0],
                    **options,
                )
            tokens = out[0, len(prompt) :].tolist()
            # transformers does not report its verification passes: left as one per token.
            return Run(
                tokens, max(time.perf_counter() - tic - prefill, 1e-9), len(tokens), 0, 0, 0, 0.0
            )

        return run

    prompts = first_prompts(load_prompts(tokenizer), args.prompts_per_class)
    methods = [
        Method("transformers plain", run=runner()),
        Method("transformers prompt lookup (10 tokens)", run=runner(prompt_lookup_num_tokens=10)),
        Method("ours, plain"),
        Method("ours, prompt lookup", lambda prompt: {"draft_sources": [PromptLookupSource()]}),
    ]
    return side_by_side(model, tokenizer, prompts, methods, args.max_tokens), "transformers plain"


# Standard formats (as in the Bumblebee comparison), each with a prompt that asks for it.
REGEX_CASES = {
    "email": (
        "Give me an email address for a bakery.",
        r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}",
    ),
    "phone": ("What is a US phone number I could call?", r"\(\d{3}\) \d{3}-\d{4}"),
    "date": ("When did the first moon landing happen?", r"\d{4}-\d{2}-\d{2}"),
    "time": ("What time do shops usually open?", r"\d{2}:\d{2}(:\d{2})?"),
    "ipv4": (
        "Give me the IP address of a home router.",
        r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)",
    ),
    "url": (
        "Give me the address of a website about cooking.",
        r"https?://[a-z0-9.-]+\.[a-z]{2,}(/[a-zA-Z0-9._~-]*)*",
    ),
    "ssn": ("Make up a social security number for a test form.", r"\d{3}-\d{2}-\d{4}"),
    "json": (
        "Describe a fictional person as JSON with a name and an age.",
        r'\{"name": "[a-zA-Z ]{1,20}", "age": \d{1,3}\}',
    ),
}


def regex_suite(model, tokenizer, args):
    """Plain vs constrained (masks only) vs constrained + forced-text drafts, at 8 and 64 new
    tokens."""
    from benchmarks.harness import chat_tokens
    from constrained import ForcedTextSource, RegexConstraint

    vocab_size = model.args.vocab_size
    prompts = {
        "all formats": [
            (name, chat_tokens(tokenizer, question)) for name, (question, _) in REGEX_CASES.items()
        ]
    }
    patterns = {tuple(chat_tokens(tokenizer, q)): p for q, p in REGEX_CASES.values()}

    def constrained(forced):
        def make(prompt):
            constraint = RegexConstraint.from_regex(patterns[tuple(prompt)], tokenizer, vocab_size)
            return {
                "constraint": constraint,
                "draft_sources": [ForcedTextSource(constraint)] if forced else [],
            }

        return make

    methods = [
        Method("plain", greedy=False),
        Method("constrained", constrained(False)),
        Method("constrained + forced drafts", constrained(True)),
    ]
    results = {}
    for max_tokens in (8, 64):
        for task, by_method in side_by_side(model, tokenizer, prompts, methods, max_tokens).items():
            results[f"{task}, {max_tokens} tokens"] = by_method
    return results, "plain"


def acceptance_suite(model, tokenizer, args):
    """Expected acceptance of a draft token under two rules, on the target's own greedy text.

    Ours, min(1, p/q), accepts with probability sum_x min(p(x), q(x)); mlx-lm's "sample the
    target and compare" accepts with sum_x p(x) q(x), which is never larger. Noise-free: one
    forward pass of each model per prompt, no sampling.
    """
    from mlx_lm import load

    from decoder import Sampling, generate_step
    from decoder.text import eos_ids_of

    prompts = load_prompts(tokenizer, ["open_ended", "extractive_qa"])
    texts = [
        prompt
        + [
            t
            for t, _ in generate_step(
                prompt, model, max_tokens=args.max_tokens, eos_token_ids=eos_ids_of(tokenizer)
            )
        ]
        for items in prompts.values()
        for _, prompt in items
    ]
    lines = [
        "| draft | temp | positions | min(1, p/q) (ours) | sample and compare (mlx-lm) |",
        "|---|---:|---:|---:|---:|",
    ]
    for num_layers in args.draft_layers:
        draft, _ = load(self_draft_path(num_layers))
        for temp in [t for t in args.temps if t > 0]:
            ours = compare = positions = 0
            for text in texts:
                inputs = mx.array(text)[None]
                p = Sampling(temp).probs(model(inputs)[0])
                q = Sampling(temp).probs(draft(inputs)[0])
                ours += mx.minimum(p, q).sum().item()
                compare += (p * q).sum().item()
                positions += p.shape[0]
            lines.append(
                f"| {num_layers} layers | {temp} | {positions} | {ours / positions:.3f} | "
                f"{compare / positions:.3f} |"
            )
    return "\n".join(lines), None


def speculative_suite(model, tokenizer, args):
    """Early-exit self-drafts of several depths; fixed vs adaptive; with prompt lookup; greedy and
    sampled."""
    from mlx_lm import load

    from decoder import Sampling
    from draft_model import DraftModel
    from prompt_lookup import PromptLookupSource

    prompts = first_prompts(
        load_prompts(tokenizer, ["open_ended", "extractive_qa"]), args.prompts_per_class
    )
    results = {}
    for temp in args.temps:
        sampling = Sampling(temp)
        methods = [Method("plain", lambda prompt, s=sampling: {"sampling": s}, greedy=temp == 0)]
        for num_layers in args.draft_layers:
            draft, _ = load(self_draft_path(num_layers))

            def source(draft=draft, **options):
                return DraftModel.create(
                    draft, tokenizer, model, tokenizer, num_draft=4, **options
                ).source()

            def method(name, make_sources, sampling=sampling):
                return Method(
                    name,
                    lambda prompt: {"sampling": sampling, "draft_sources": make_sources()},
                    greedy=temp == 0,
                )

            methods += [
                Method(
                    f"mlx-lm speculative, draft {num_layers} layers, k=4",
                    run=mlx_lm_speculative_runner(model, tokenizer, draft, 4, temp),
                    greedy=temp == 0,
                ),
                method(
                    f"draft {num_layers} layers, k=4 fixed",
                    lambda s=source: [s(adaptive=False, min_confidence=0.0)],
                ),
                method(
                    f"draft {num_layers} layers, adaptive, no confidence stop",
                    lambda s=source: [s(min_confidence=0.0)],
                ),
                method(f"draft {num_layers} layers, adaptive (default)", lambda s=source: [s()]),
                method(
                    f"draft {num_layers} layers, adaptive + prompt lookup",
                    lambda s=source: [PromptLookupSource(), s()],
                ),
            ]
        for task, by_method in side_by_side(
            model, tokenizer, prompts, methods, args.max_tokens
        ).items():
            results[f"{task}, temp {temp}"] = by_method
    return results, "plain"


SUITES = {
    "plain": plain_suite,
    "prompt_lookup": prompt_lookup_suite,
    "regex": regex_suite,
    "speculative": speculative_suite,
    "acceptance": acceptance_suite,
    "transformers": transformers_suite,
    "draft_head": draft_head_suite,
    "draft_head_cost": draft_head_cost_suite,
    "draft_head_misses": draft_head_misses_suite,
}


def main():
    parser = argparse.ArgumentParser(description="Side-by-side decoding benchmarks.")
    parser.add_argument("--suite", choices=sorted(SUITES) + ["all"], default="plain")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument(
        "--num-draft-sweep",
        type=int,
        nargs="*",
        default=None,
        help="Also run fixed draft lengths (prompt lookup suite).",
    )
    parser.add_argument(
        "--prompts-per-class",
        type=int,
        default=None,
        help="Use only the first N prompts of each task class (speculative, transformers).",
    )
    parser.add_argument(
        "--draft-layers",
        type=int,
        nargs="*",
        default=[4, 8, 15],
        help="Self-draft depths to try (speculative suite).",
    )
    parser.add_argument(
        "--temps",
        type=float,
        nargs="*",
        default=[0.0, 1.0],
        help="Temperatures (speculative and draft_head suites).",
    )
    parser.add_argument(
        "--head",
        default=None,
        help="Draft head directory (draft_head suites; default: the shipped one).",
    )
    parser.add_argument(
        "--classes",
        nargs="*",
        default=None,
        help="Task classes to run (draft_head suite; default: heldout_chat, open_ended, "
        "extractive_qa).",
    )
    args = parser.parse_args()

    model, tokenizer, path = load_model()
    command = " ".join(["python -m benchmarks.run", *sys.argv[1:]])
    header = (
        f"`{command}` · {datetime.date.today()} · {platform.node() or 'this machine'} · "
        f"{describe_backend()} · SmolLM2-135M-Instruct {default_dtype()} · greedy · max "
        f"{args.max_tokens} new tokens · mlx {mx.__version__}"
    )
    print(header)
    RESULTS.mkdir(exist_ok=True)
    # "all" leaves out the transformers comparison, which needs the dev-only torch.
    for name in [s for s in SUITES if s != "transformers"] if args.suite == "all" else [args.suite]:
        print(f"\n## {name}")
        results, baseline = SUITES[name](model, tokenizer, args)
        table = results if isinstance(results, str) else markdown_table(results, baseline)
        print(table)
        path = RESULTS / f"{name}.md"
        if path.exists() and not path.read_text().startswith("`python -m benchmarks.run"):
            path = RESULTS / f"{name}.latest.md"  # the .md holds a hand-written analysis: keep it
        path.write_text(f"{header}\n\n{table}\n")
        print(f"(saved in {path})")


if __name__ == "__main__":
    main()
