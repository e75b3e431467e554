"""Peak memory of a batch of a sliding-window model: mlx-lm's BatchGenerator and ours, side by side.

    flock /tmp/cpu.lock python -m benchmarks.sliding_memory [--contexts 2048 4096 8192] [--rows 4]

Random models of two shapes whose KV caches dominate (tiny widths, many key/value heads, float32:
MLX's CPU runs a mixture of experts in float32 only): Gemma 3 (one layer in six global, the others a
window of 1,024) and GPT-OSS (sliding and global layers in turn, a window of 128, a mixture of
experts). Each batch holds ``--rows`` prompts of the context length and generates ``--max-tokens``
tokens greedily; each engine prefills in chunks of 512. Peak memory is MLX's
(``mx.get_peak_memory``) from the insert to the last token, the methods run in turn (A B A B) and
each one's lowest peak counts. Writes benchmarks/results/sliding_memory.md.
"""

import argparse
import platform
from pathlib import Path

from loading import fast_blas

fast_blas.load()

import mlx.core as mx  # noqa: E402
from mlx_lm.utils import _get_classes  # noqa: E402

from batch import BatchGenerator  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "sliding_memory.md"
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=64,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
    attention_bias=False,
    rope_scaling=None,
)
SHAPES = {
    "Gemma 3 (window 1024, 5 of 6 layers sliding)": dict(
        model_type="gemma3_text",
        num_hidden_layers=12,
        sliding_window=1024,
        sliding_window_pattern=6,
        query_pre_attn_scalar=64,
    ),
    "GPT-OSS (window 128, every other layer sliding)": dict(
        model_type="gpt_oss",
        num_hidden_layers=12,
        sliding_window=128,
        num_local_experts=4,
        num_experts_per_tok=2,
        experts_per_token=2,
        layer_types=["sliding_attention", "full_attention"] * 6,
    ),
}


def build(shape: dict):
    config = {**COMMON, **shape}
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    return model


def peak_mlx_lm(model, prompts: list, max_tokens: int) -> float:
    from mlx_lm.generate import BatchGenerator as MlxBatchGenerator

    mx.clear_cache()
    mx.reset_peak_memory()
    generator = MlxBatchGenerator(
        model,
        stop_tokens=[],
        max_tokens=max_tokens,
        prefill_batch_size=len(prompts),
        completion_batch_size=len(prompts),
        prefill_step_size=512,
    )
    generator.insert(prompts, [max_tokens] * len(prompts))
    while generator.next_generated():
        pass
    generator.close()
    return mx.get_peak_memory() / 1e9


def peak_ours(model, prompts: list, max_tokens: int) -> float:
    mx.clear_cache()
    mx.reset_peak_memory()
    generator = BatchGenerator(model, prefill_batch_size=len(prompts), prefill_step_size=512)
    generator.insert(prompts, max_tokens=max_tokens)
    while generator.next():
        pass
    return mx.get_peak_memory() / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument(
        "--models", nargs="+", default=["Gemma 3", "GPT-OSS"], help="which shapes (name prefixes)"
    )
    parser.add_argument("--out", default=str(RESULTS), help="results file ('' to print only)")
    args = parser.parse_args()
    lines = [
        "| model | context | mlx-lm peak GB | ours peak GB | ours / mlx-lm |",
        "|---|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for name, shape in SHAPES.items():
        if not any(name.startswith(prefix) for prefix in args.models):
            continue
        model = build(shape)
        for context in args.contexts:
            prompts = [
                [(31 * i + 7 * row) % 250 + 3 for i in range(context)] for row in range(args.rows)
            ]
            peaks = {"mlx-lm": [], "ours": []}
            for _ in range(args.repeat):
                peaks["mlx-lm"].append(peak_mlx_lm(model, prompts, args.max_tokens))
                peaks["ours"].append(peak_ours(model, prompts, args.max_tokens))
            theirs, ours = min(peaks["mlx-lm"]), min(peaks["ours"])
            lines.append(
                f"| {name} | {context} | {theirs:.3f} | {ours:.3f} | {ours / theirs:.2f}x |"
            )
            print(lines[-1], flush=True)
    if args.out:
        header = (
            f"# Peak memory of batched sliding-window models\n\n{platform.machine()}, MLX "
            f"{mx.__version__} CPU, float32, {args.rows} rows of the context length, "
            f"{args.max_tokens} new tokens, greedy.\n\n"
            "```\nflock /tmp/cpu.lock python -m benchmarks.sliding_memory "
            + f"--contexts {' '.join(map(str, args.contexts))} --rows {args.rows}\n```\n\n"
        )
        Path(args.out).write_text(header + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
