"""MTP drafts: what one MTP draft step costs against a target step, and the speed-up acceptance
buys.

    flock /tmp/cpu.lock python -m benchmarks.mtp [--vocab 256 --layers 8 --max-tokens 128 --repeat
    2]

No checkpoint that ships MTP layers fits this machine, so the models are random ones of each layout
(deepseek_v3 with MLA and experts; qwen3_next, hybrid) built by tests/mtp_fixtures.py, at a width of
2 x vocab: "exact" is wired so that its MTP layer predicts the target (the acceptance a trained MTP
layer approaches), "noisy" is the same with noise on every weight (a lower acceptance). Per layout:

1. One MTP draft step (the layer and its scoring, one token) against one target step (one token
   after the prompt), timed alternately, medians: the draft cost ratio c.
2. Plain decoding and MTP drafts side by side, interleaved, greedy (outputs must match): tok/s,
   target passes per token, acceptance by draft position.
3. The expected speed-up from that acceptance, (1 + sum_i prod_{j<=i} a_j) / (1 + k c + (k) t), for
   this CPU's measured cost t of a verified token, and for a GPU-like curve (t = 0.005, the
   simulated clock of benchmarks/batch.py --simulate-rows), at the best k.
4. A continuous batch of ``--batch`` rows with prompts of different lengths, plain and with MTP
   drafts per row, interleaved (outputs must match): tok/s in all, passes per token, peak memory.
It writes benchmarks/results/mtp.md.
"""

import argparse
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx

from batch import BatchGenerator
from decoder import generate_step
from decoder.cache import make_cache
from decoder.hidden_states import HiddenStateTap
from decoder.pass_cost import PassCost
from decoder.row import DecodingStats
from loading.load import describe_backend
from mtp.source import MTPDrafter
from tests.mtp_fixtures import build

RESULTS = Path(__file__).parent / "results" / "mtp.md"
# benchmarks/batch.py's SimulatedClock: a verified token costs 0.5% of a step
GPU_TOKEN_COST = 0.005


def sizes(model_type: str, vocab: int, layers: int) -> dict:
    common = dict(
        vocab_size=vocab,
        hidden_size=2 * vocab,
        num_hidden_layers=layers,
        intermediate_size=4 * vocab,
        moe_intermediate_size=vocab,
        num_experts_per_tok=2,
    )
    if model_type == "deepseek_v3":
        return {
            **common,
            "n_routed_experts": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "kv_lora_rank": 128,
            "q_lora_rank": 192,
            "qk_rope_head_dim": 32,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
        }
    return {
        **common,
        "num_experts": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "full_attention_interval": 4,
        "shared_expert_intermediate_size": 2 * vocab,
        "linear_num_value_heads": 8,
        "linear_num_key_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
    }


def step_costs(target, mtp, prompt: list, repeat: int = 40) -> tuple:
    """Median seconds of one target step and one MTP draft step (one token each), timed
    alternately."""
    cache, draft_cache = make_cache(target).layers, mtp.make_cache()
    hidden = target.model(mx.array([prompt]), cache=cache)
    embeddings = target.model.embed_tokens(mx.array([prompt[1:] + [prompt[0]]]))
    mx.eval(mtp(hidden, embeddings, cache=draft_cache))
    token, feature = mx.array([[prompt[-1]]]), hidden[:, -1:]
    target_times, draft_times = [], []
    for _ in range(repeat):
        tic = time.perf_counter()
        mx.eval(target(token, cache=cache))
        target_times.append(time.perf_counter() - tic)
        tic = time.perf_counter()
        mx.eval(mtp.logits(mtp(feature, embeddings[:, -1:], cache=draft_cache)))
        draft_times.append(time.perf_counter() - tic)
        for layer in cache + draft_cache:
            if layer.is_trimmable():
                layer.trim(1)
    return statistics.median(target_times), statistics.median(draft_times)


def decode(target, prompt, max_tokens, sources=(), model=None) -> tuple:
    stats, cost = DecodingStats(), PassCost()
    tic = time.perf_counter()
    tokens = [
        t
        for t, _ in generate_step(
            prompt,
            model or target,
            draft_sources=sources,
            eos_token_ids=(),
            max_tokens=max_tokens,
            stats=stats,
            pass_cost=cost,
        )
    ]
    return tokens, len(tokens) / (time.perf_counter() - tic), stats, cost


def decode_batch(model, prompts, max_tokens, drafter=None) -> tuple:
    """Every prompt in one ``BatchGenerator``: (tokens per row, tok/s in all, target passes per
    token, peak GB)."""
    generator = BatchGenerator(model, eos_token_ids=(), drafters=[drafter] if drafter else [])
    mx.reset_peak_memory()
    tic = time.perf_counter()
    sources = [[drafter.source()] if drafter is not None else [] for _ in prompts]
    uids = generator.insert(prompts, max_tokens=max_tokens, draft_sources=sources)
    out = {uid: [] for uid in uids}
    while responses := generator.next():
        for response in responses:
            out[response.uid] += response.tokens
    seconds, total = time.perf_counter() - tic, sum(len(tokens) for tokens in out.values())
    return (
        [out[uid] for uid in uids],
        total / seconds,
        generator.stats.row_passes / total,
        mx.get_peak_memory() / 1e9,
    )


def batch_lines(model_type: str, kind: str, target, mtp, prompts: list, args) -> list:
    """Plain and MTP-drafting batches, interleaved, ``args.repeat`` times; the best run of each."""
    runs = {"plain": [], "mtp adaptive": []}
    for _ in range(args.repeat):
        plain = decode_batch(target, prompts, args.max_tokens)
        tap, drafter = MTPDrafter.around(target, mtp, mx.arange(args.vocab), max_draft=8)
        drafted = decode_batch(tap, prompts, args.max_tokens, drafter)
        assert drafted[0] == plain[0], "MTP drafts changed a row's greedy output"
        runs["plain"].append(plain)
        runs["mtp adaptive"].append(drafted)
    base = max(run[1] for run in runs["plain"])
    lines = []
    for name, results in runs.items():
        _, tps, passes, peak = max(results, key=lambda run: run[1])
        lines.append(
            f"| {model_type} | {kind} | {len(prompts)} | {name} | {tps:.1f} | {tps / base:.2f}x | "
            f"{passes:.2f} | {peak:.3f} |"
        )
        print(lines[-1], flush=True)
    return lines


def expected_speedup(acceptance: list, draft_cost: float, token_cost: float) -> tuple:
    """(best k, speed-up) of drafting k tokens with per-position acceptance ``acceptance``."""
    best, reach, accepted = (0, 1.0), 1.0, 0.0
    for k, rate in enumerate(acceptance, start=1):
        reach *= rate
        accepted += reach
        speedup = (1 + accepted) / (1 + k * draft_cost + k * token_cost)
        best = max(best, (k, speedup), key=lambda pair: pair[1])
    return best


def single_lines(model_type: str, kind: str, target, mtp, prompt: list, args) -> list:
    """One sequence: the draft step's cost, then plain and MTP decoding interleaved; a table row per
    method."""
    lines = []
    target_step, draft_step = step_costs(target, mtp, prompt)
    ratio = draft_step / target_step
    tap = HiddenStateTap(target, mtp.feature_layers)
    runs = {"plain": [], "mtp adaptive": [], f"mtp k={args.num_draft}": []}
    for _ in range(args.repeat):  # interleaved: plain, adaptive, fixed, plain, ...
        plain = decode(target, prompt, args.max_tokens)
        runs["plain"].append(plain)
        for name, adaptive in (("mtp adaptive", True), (f"mtp k={args.num_draft}", False)):
            source = MTPDrafter(
                tap,
                mtp,
                mx.arange(args.vocab),
                num_draft=args.num_draft,
                adaptive=adaptive,
                max_draft=8,
                draft_cost_prior=ratio,
            ).source()
            run = decode(target, prompt, args.max_tokens, [source], tap)
            assert run[0] == plain[0], "MTP drafts changed the greedy output"
            runs[name].append(run)
    base = max(r[1] for r in runs["plain"])
    token_cost = runs["plain"][-1][3].token_cost()
    for name, results in runs.items():
        # its statistics with its rate: the policy reads timings
        best = max(results, key=lambda r: r[1])
        tps, stats = best[1], best[2]
        passes = stats.target_forward_passes / max(len(best[0]), 1)
        by_position, cpu, gpu = "-", "-", "-"
        if "mtp" in stats.sources:
            summary = stats.sources["mtp"].summary()
            by_position = ", ".join(f"{a:.2f}" for a in summary["acceptance_by_position"])
            if name.startswith("mtp k="):
                by_k = summary["acceptance_by_position"]
                cpu, gpu = (
                    "%.2fx (%d)" % expected_speedup(by_k, ratio, cost)[::-1]
                    for cost in (token_cost, GPU_TOKEN_COST)
                )
        lines.append(
            f"| {model_type} | {kind} | {ratio:.3f} | {name} | {tps:.1f} | {tps / base:.2f}x | "
            f"{passes:.2f} | {by_position} | {cpu} | {gpu} |"
        )
        print(lines[-1], flush=True)
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--vocab", type=int, default=256, help="vocabulary; the width is twice this"
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--num-draft", type=int, default=4, help="fixed draft length for the acceptance curve"
    )
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument(
        "--noise", type=float, default=0.015, help="noise on every weight of the 'noisy' models"
    )
    parser.add_argument(
        "--batch", type=int, default=4, help="rows of the continuous batch (0: skip it)"
    )
    args = parser.parse_args()
    prompt = list(range(3, 60, 7)) * 4
    lines = [
        "# MTP drafts",
        "",
        f"Machine: {platform.machine()}, {describe_backend()}; float32; random models of each "
        f"layout (tests/mtp_fixtures.py), vocabulary {args.vocab}, width {2 * args.vocab}, "
        f"{args.layers} layers, a {len(prompt)}-token prompt, {args.max_tokens} tokens, greedy.",
        "",
        "    flock /tmp/cpu.lock python -m benchmarks.mtp "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "",
        "| layout | MTP layer | draft step / target step | method | tok/s | vs plain | "
        "passes/token | acceptance by position | expected speed-up, this CPU (k) | GPU-like curve "
        "(k) |",
        "|---|---|---:|---|---:|---:|---:|---|---:|---:|",
    ]
    batch_table = [
        "",
        f"A continuous batch of {args.batch} rows (prompts of different lengths), every row "
        "drafting with its own MTP handle, against the same batch without drafts, interleaved:",
        "",
        "| layout | MTP layer | rows | method | tok/s in all | vs plain | passes/token | peak GB |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    batch_prompts = [prompt[: len(prompt) - 5 * row] for row in range(args.batch)]
    for model_type in ("deepseek_v3", "qwen3_next"):
        for kind, noise in (("exact", 0.0), ("noisy", args.noise)):
            _, target, mtp = build(
                model_type,
                seed=0,
                exact=True,
                noise=noise,
                **sizes(model_type, args.vocab, args.layers),
            )
            lines += single_lines(model_type, kind, target, mtp, prompt, args)
            if args.batch:
                batch_table += batch_lines(model_type, kind, target, mtp, batch_prompts, args)
    lines += [
        "",
        "The draft cost ratio is the MTP layer with its scoring (its own head, or the target's "
        "for qwen3_next) against all of the target's layers and head, for one token: about "
        "1/layers plus the head, and the experts read for one token. The expected speed-up uses "
        "the measured ratio for the drafting, the fitted cost of one more verified token (this "
        "CPU's, or the GPU-like 0.005 of a step), and the acceptance by position of the "
        f"fixed-length run; the best k is shown. tok/s is the best of {args.repeat} interleaved "
        "runs, shown with that run's passes and acceptance (the adaptive length reads measured "
        "timings, so its runs differ).",
    ]
    RESULTS.write_text("\n".join(lines + (batch_table if args.batch else [])) + "\n")


if __name__ == "__main__":
    main()
