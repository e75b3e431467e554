"""Per-row rollback in one batch KV cache: the cost of a verification step, two designs side by
side.

    python -m benchmarks.batch_cache [--rows 8] [--contexts 1024 4096] [--width 5] [--steps 8]

Each step scores ``[rows, width]`` tokens and every row keeps a random ``1 + accepted`` of them:

- roll: mlx-lm's ``BatchKVCache``; trim the tail every row rejects, then roll each row right by the
  rest (``prepare(right_padding=...)`` / ``finalize()``, as mlx-lm pads prompts): a copy per step.
- ragged: ``cache.KVRows``; each row keeps its own end, the next pass writes over the
  rejected slots (one scatter), the mask hides them.

Both start from the same cached keys and values (random: a step's cost does not depend on them,
and prefilling 8 x 4k tokens would take minutes on a CPU). Plain ``[rows, 1]`` steps and a
``[rows, width]`` pass whose rows all keep the same count (one shared trim) are the baselines.
"""

import argparse
import random
import time

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from decoder.cache import KVRows
from loading.load import load_model


def filled(model, rows: int, context: int, make):
    """One cache per layer holding ``context`` random keys and values per row."""
    args = model.args
    heads, head_dim = (
        args.num_key_value_heads,
        args.head_dim or args.hidden_size // args.num_attention_heads,
    )
    dtype = model.model.embed_tokens.weight.dtype
    caches = []
    for _ in model.layers:
        cache = make()
        keys = mx.random.normal((rows, heads, context, head_dim)).astype(dtype)
        cache.update_and_fetch(keys, mx.random.normal(keys.shape).astype(dtype))
        caches.append(cache)
    mx.eval([c.state for c in caches])
    return caches


def rollback_shared(caches, dead):
    for cache in caches:  # as if every row kept the same count: the floor any design can reach
        cache.trim(max(dead))


def rollback_roll(caches, dead):
    common = min(dead)
    for cache in caches:
        cache.trim(common)
        cache.prepare(right_padding=[d - common for d in dead])
        cache.finalize()


def rollback_ragged(caches, dead):
    for cache in caches:  # each row moves its own end back
        cache.trim_rows(dead)


def timed_steps(model, caches, rows, width, steps, rollback, rng):
    times = []
    for step in range(steps + 2):
        inputs = mx.array([[rng.randrange(1000) for _ in range(width)] for _ in range(rows)])
        tic = time.perf_counter()
        logits = model(inputs, cache=caches)
        mx.eval(logits.argmax(-1))
        if width > 1:
            rollback(caches, [width - 1 - rng.randrange(width) for _ in range(rows)])
            mx.eval([c.state for c in caches])
        if step >= 2:  # two warm-up steps
            times.append(time.perf_counter() - tic)
    times.sort()
    return times[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--width", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    model, _, _ = load_model()
    rng = random.Random(0)
    print(
        "| context | plain [B,1] step ms | [B,W], one shared trim ms | roll: [B,W] + rollback ms "
        "| ragged: [B,W] + rollback ms |"
    )
    print("|---:|---:|---:|---:|---:|")
    for context in args.contexts:
        plain = timed_steps(
            model,
            filled(model, args.rows, context, lambda: BatchKVCache([0] * args.rows)),
            args.rows,
            1,
            args.steps,
            None,
            rng,
        )
        shared = timed_steps(
            model,
            filled(model, args.rows, context, lambda: BatchKVCache([0] * args.rows)),
            args.rows,
            args.width,
            args.steps,
            rollback_shared,
            rng,
        )
        roll = timed_steps(
            model,
            filled(model, args.rows, context, lambda: BatchKVCache([0] * args.rows)),
            args.rows,
            args.width,
            args.steps,
            rollback_roll,
            rng,
        )
        ragged = timed_steps(
            model,
            filled(model, args.rows, context, lambda: KVRows(args.rows)),
            args.rows,
            args.width,
            args.steps,
            rollback_ragged,
            rng,
        )
        print(
            f"| {context} | {plain * 1e3:.1f} | {shared * 1e3:.1f} | {roll * 1e3:.1f} | "
            f"{ragged * 1e3:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
