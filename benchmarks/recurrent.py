"""What rolling back a hybrid model's recurrent state costs per verify pass (cache/).

    flock /tmp/bench.lock python -m benchmarks.recurrent [--hidden 512] [--layers 8] [--context 256]

A random Qwen3-Next (gated-delta layers with one attention layer in four, mixture of experts) at
float32. A pass with a draft first keeps the recurrent states (``Cache.checkpoint``: references);
when a draft token is rejected the states go back to them and the pass's accepted tokens are fed
again. Side by side, medians of interleaved repeats:

- the pass itself: a plain ``[1, 1]`` step and a ``[1, 1 + k]`` verify pass;
- the checkpoint and the restore (host work and the cache's own trim);
- a rejection handled two ways: the accepted tokens fed again at the front of the next pass (what
  the loop does: a ``[1, p + k]`` pass instead of ``[1, 1 + k]``), or run through at once in a pass
  of their own (``[1, p]``, then the next ``[1, 1 + k]``);
- in a batch of 8 rows, putting 4 rows back to their checkpoint;
- end to end, prompt lookup over a near-copy of the answer against plain decoding: tok/s, target
  passes per token and restores per token.

Writes benchmarks/results/recurrent.md.
"""

import argparse
import statistics
import time
from pathlib import Path

from loading import fast_blas

fast_blas.load()

import mlx.core as mx  # noqa: E402
from mlx_lm.models import qwen3_next  # noqa: E402

from decoder import generate_step  # noqa: E402
from decoder.cache import Cache, make_cache  # noqa: E402
from decoder.prefill import prefill_rows  # noqa: E402
from decoder.row import DecodingStats  # noqa: E402
from prompt_lookup import PromptLookupSource  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "recurrent.md"


def build(hidden: int, layers: int, vocab: int):
    mx.random.seed(0)
    heads = hidden // 64
    args = qwen3_next.ModelArgs(
        model_type="qwen3_next",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 1),
        head_dim=64,
        vocab_size=vocab,
        linear_num_value_heads=heads,
        linear_num_key_heads=max(heads // 2, 1),
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=hidden // 2,
        moe_intermediate_size=hidden // 2,
        mlp_only_layers=[],
        full_attention_interval=4,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    model = qwen3_next.Model(args)
    model.lm_head.weight = model.lm_head.weight * 8  # sharp enough that greedy text repeats itself
    mx.eval(model.parameters())
    return model


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def pass_costs(model, context: int, draft: int, pending: int, repeats: int) -> dict:
    """Seconds of each pass shape and of the rollback steps, from one cache at ``context``
    tokens."""
    cache = make_cache(model)
    model(mx.arange(context)[None] % 1000, cache=cache.layers)
    mx.eval(cache.arrays())

    def run(width: int, keep: bool = False):
        cache.checkpoint()
        mx.eval(model(mx.arange(width)[None] + 7, cache=cache.layers))
        if not keep:
            cache.rewind([width], [0])  # back to the context, for the next repeat

    shapes = {
        "plain [1, 1] step": 1,
        f"verify pass [1, {1 + draft}]": 1 + draft,
        f"verify pass with {pending} tokens fed again [1, {pending + draft}]": pending + draft,
        f"the re-feed alone [1, {pending}]": pending,
    }
    costs = {name: [] for name in shapes}
    for _ in range(repeats):  # interleaved
        for name, width in shapes.items():
            costs[name].append(timed(lambda: run(width), 1))
    costs = {name: statistics.median(times) for name, times in costs.items()}

    def checkpoint_and_restore():
        cache.checkpoint()
        out = model(mx.arange(1 + draft)[None] + 3, cache=cache.layers)
        mx.eval(out)
        tic = time.perf_counter()
        cache.rewind([1 + draft], [0])
        mx.eval(cache.arrays())
        return time.perf_counter() - tic

    costs["checkpoint (host)"] = timed(cache.checkpoint, repeats * 10)
    costs["restore and trim after a rejection"] = statistics.median(
        checkpoint_and_restore() for _ in range(repeats)
    )
    return costs


def batch_restore(model, rows: int, restored: int, repeats: int) -> float:
    cache = prefill_rows(model, [[i % 100 for i in range(64 + row)] for row in range(rows)])

    def restore():
        cache.checkpoint()
        model(mx.ones((rows, 3), mx.int32), cache=cache.layers)
        mx.eval(cache.arrays())
        tic = time.perf_counter()
        cache.rewind([0] * rows, list(range(restored)))
        mx.eval(cache.arrays())
        cache.rewind([3] * rows)
        return time.perf_counter() - tic

    return statistics.median(restore() for _ in range(repeats))


def end_to_end(model, max_tokens: int, repeats: int) -> list:
    prompt = [5, 9, 13, 2, 8, 21, 34, 1, 7, 44] * 3
    plain = [t for t, _ in generate_step(prompt, model, eos_token_ids=(), max_tokens=max_tokens)]
    near_copy = [t if i % 11 != 5 else (t + 1) % 1000 for i, t in enumerate(plain)]
    restores, rewind = [0], Cache.rewind

    # a rewind with rows to restore went back to a checkpoint
    def counted(self, trims, restored=()):
        restores[0] += bool(restored)
        return rewind(self, trims, restored)

    Cache.rewind = counted
    rows = []
    for name, sources in (
        ("plain", lambda: []),
        ("prompt lookup over a near-copy", lambda: [PromptLookupSource(extra_context=near_copy)]),
    ):
        times, stats = [], None
        for _ in range(repeats):
            stats, restores[0] = DecodingStats(), 0
            tic = time.perf_counter()
            out = [
                t
                for t, _ in generate_step(
                    prompt,
                    model,
                    eos_token_ids=(),
                    draft_sources=sources(),
                    max_tokens=max_tokens,
                    stats=stats,
                )
            ]
            times.append(time.perf_counter() - tic)
            assert out == plain, "lossless: the same tokens as plain decoding"
        rows.append(
            (
                name,
                max_tokens / statistics.median(times),
                stats.target_forward_passes / max_tokens,
                stats.draft_proposed,
                stats.draft_accepted,
                restores[0],
            )
        )
    Cache.rewind = rewind
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--draft", type=int, default=4, help="draft tokens in a verify pass")
    parser.add_argument("--pending", type=int, default=3, help="tokens fed again after a rejection")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    model = build(args.hidden, args.layers, args.vocab)
    costs = pass_costs(model, args.context, args.draft, args.pending, args.repeats)
    step = costs["plain [1, 1] step"]
    lines = [
        f"`python -m benchmarks.recurrent --hidden {args.hidden} --layers {args.layers} --context "
        f"{args.context}` · {time.strftime('%Y-%m-%d')} · {fast_blas.describe()} · random "
        f"Qwen3-Next, float32, {args.layers} layers ({args.layers // 4} attention), hidden "
        f"{args.hidden}, 8 experts",
        "",
        "| what | ms | of a plain step |",
        "|---|---:|---:|",
    ]
    lines += [
        f"| {name} | {seconds * 1e3:.2f} | {seconds / step:.3f} |"
        for name, seconds in costs.items()
    ]
    verify = costs[f"verify pass [1, {1 + args.draft}]"]
    deferred = (
        costs[f"verify pass with {args.pending} tokens fed again [1, {args.pending + args.draft}]"]
        - verify
    )
    at_once = costs[f"the re-feed alone [1, {args.pending}]"]
    lines += [
        "",
        f"A rejection costs the loop {deferred * 1e3:.2f} ms ({deferred / step:.3f} of a step) of "
        f"wider pass; re-advancing at once would cost {at_once * 1e3:.2f} ms "
        f"({at_once / step:.3f}).",
        "",
    ]
    restore = batch_restore(model, 8, 4, args.repeats)
    lines += [
        f"In a batch of 8 rows, putting 4 back to their checkpoint: {restore * 1e3:.2f} ms "
        f"({restore / step:.3f} of a one-row step).",
        "",
    ]
    lines += [
        f"End to end, {args.max_tokens} tokens, greedy (both give the same tokens):",
        "",
        "| method | tok/s | passes/token | drafted | accepted | restores |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, tps, passes, proposed, accepted, restores in end_to_end(
        model, args.max_tokens, max(args.repeats // 3, 1)
    ):
        lines.append(
            f"| {name} | {tps:.1f} | {passes:.3f} | {proposed} | {accepted} | {restores} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.write_text("# Rolling back recurrent layers\n\n" + text)


if __name__ == "__main__":
    main()
