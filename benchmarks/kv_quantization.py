"""KV cache quantization (--kv-bits): what it costs in quality, what it saves in memory, and its
decoding speed, on the embedded model.

    flock /tmp/bench.lock python -m benchmarks.kv_quantization [--quality-tokens 4096]
        [--rows 4] [--context 1024] [--decode-tokens 32]
    flock /tmp/bench.lock python -m benchmarks.kv_quantization --long-only [--long-rows 4]
        [--long-context 8192] [--single-context 16384]

- **Quality**: the repo's docs (README.md and docs/*.md, raw tokens, none of it seen in training)
  run through the model in chunks of 512 with each cache; perplexity of every next token, and how
  often the argmax agrees with float32's.
- **Memory**: ``--rows`` prompts of ``--context`` tokens prefilled into one batch cache: the bytes
  the cache holds and MLX's peak memory, against float32 and against mlx-lm's one-stream cache
  (``QuantizedKVCache``) at the same length.
- **Memory at length** (``--long-only``): ``--long-rows`` rows of ``--long-context`` tokens in
  one batch cache and one row of ``--single-context``, ours and mlx-lm's one-stream cache, with
  random keys and values written in (no prefill: an hour's work on this CPU at these lengths).
- **Speed**: one row decoding ``--decode-tokens`` tokens after a ``--context`` prompt, plain, each
  width in turn, twice (A B C A B C); the better run counts.
"""

import argparse
import math
import platform
import time
from pathlib import Path

from loading import fast_blas

fast_blas.load()

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from decoder import generate_step  # noqa: E402
from decoder.cache import make_cache  # noqa: E402
from decoder.prefill import Prefill  # noqa: E402
from loading.load import describe_backend, load_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "kv_quantization.md"
LONG = ROOT / "benchmarks" / "results" / "kv_quantization_long.md"
WIDTHS = [None, 8, 4]


def name(bits) -> str:
    return "float32" if bits is None else f"{bits}-bit"


def quality(model, tokens: list, bits) -> tuple:
    """(perplexity, argmaxes) over ``tokens``, fed in chunks of 512 through a cache of ``bits``."""
    cache, nll, argmaxes = make_cache(model, kv_bits=bits), 0.0, []
    for start in range(0, len(tokens) - 1, 512):
        chunk = tokens[start : min(start + 512, len(tokens) - 1)]
        logits = model(mx.array([chunk]), cache=cache.layers)[0].astype(mx.float32)
        targets = mx.array(tokens[start + 1 : start + 1 + len(chunk)])
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll -= mx.take_along_axis(logprobs, targets[:, None], axis=-1).sum().item()
        argmaxes += mx.argmax(logits, axis=-1).tolist()
    return math.exp(nll / (len(tokens) - 1)), argmaxes


def memory(model, prompts: list, bits) -> tuple:
    """(cache bytes, peak GB) of the prompts prefilled into one cache of ``bits``."""
    mx.clear_cache()
    mx.reset_peak_memory()
    cache = Prefill(model, prompts, kv_bits=bits).run()
    held = sum(array.nbytes for array in cache.arrays())
    return held, mx.get_peak_memory() / 1e9


def mlx_lm_bytes(model, prompt: list, bits) -> int:
    """mlx-lm's one-stream cache of ``prompt``: ``KVCache``, or quantized as ``--kv-bits`` does."""
    cache = [KVCache() for _ in model.layers]
    model(mx.array([prompt]), cache=cache)
    if bits is not None:
        cache = [layer.to_quantized(group_size=64, bits=bits) for layer in cache]
    mx.eval([layer.state for layer in cache])
    return sum(layer.nbytes for layer in cache)


def written(model, rows: int, length: int, bits, mlx_lm: bool = False) -> tuple:
    """(cache bytes, peak GB) of ``rows`` rows of ``length`` tokens written into a cache of
    ``bits`` 512 at a time: random keys and values of the model's shapes, not a prefill (what the
    cache holds at lengths this CPU would take an hour to prefill). ``mlx_lm``: into mlx-lm's
    one-stream ``KVCache``, quantized after the first chunk as its ``--kv-bits`` does (its
    ``maybe_quantize_kv_cache`` after a pass, start 0)."""
    probe = make_cache(model)
    model(mx.array([[0]]), cache=probe.layers)
    heads, dim = probe.attention[0].keys.shape[1], probe.attention[0].keys.shape[3]
    del probe
    mx.clear_cache()
    mx.reset_peak_memory()
    if mlx_lm:
        layers = [KVCache() for _ in model.layers]
    else:
        layers = make_cache(model, rows, kv_bits=bits).attention
    for start in range(0, length, 512):
        shape = (rows, heads, min(512, length - start), dim)
        for layer in layers:
            layer.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
        if mlx_lm and bits is not None and start == 0:
            layers = [layer.to_quantized(group_size=64, bits=bits) for layer in layers]
        mx.eval(arrays_of(layers))
    return sum(layer.nbytes for layer in layers), mx.get_peak_memory() / 1e9


def arrays_of(layers: list) -> list:
    return [a for layer in layers for _, a in tree_flatten(layer.state) if isinstance(a, mx.array)]


def long_memory(model, rows: int, context: int, single: int) -> list:
    """The results file's lines for ``written``: ``rows`` rows of ``context`` tokens in one batch
    cache, and one row of ``single`` tokens, ours and mlx-lm's."""
    lines = [
        "",
        f"## Memory at length: {rows} rows of {context} tokens, and one row of {single}",
        "",
        "Keys and values of the model's shapes written without a prefill (`written`).",
        "",
        "| cache | batch bytes | vs float32 | peak GB | one row: bytes | peak GB | mlx-lm one "
        "row: bytes | peak GB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = None
    for bits in WIDTHS:
        held, peak = written(model, rows, context, bits)
        one, one_peak = written(model, 1, single, bits)
        theirs, theirs_peak = written(model, 1, single, bits, mlx_lm=True)
        base = base or held
        lines.append(
            f"| {name(bits)} | {held / 1e9:.3f} GB | {held / base:.3f}x | {peak:.3f} | "
            f"{one / 1e9:.3f} GB | {one_peak:.3f} | {theirs / 1e9:.3f} GB | {theirs_peak:.3f} |"
        )
        print(lines[-1], flush=True)
    return lines


def write_long(model, args):
    """``--long-only``: ``long_memory``'s table in its own results file."""
    lines = long_memory(model, args.long_rows, args.long_context, args.single_context)
    command = (
        "`flock /tmp/bench.lock python -m benchmarks.kv_quantization --long-only --long-rows "
        f"{args.long_rows} --long-context {args.long_context} --single-context "
        f"{args.single_context}`"
    )
    header = ["# KV cache quantization at length (#58)", "", command, "", describe_backend()]
    Path(args.out or LONG).write_text("\n".join(header + lines) + "\n")


def speed(model, prompt: list, bits, count: int, start: int = 0) -> float:
    steps = generate_step(
        prompt, model, eos_token_ids=(), max_tokens=count, kv_bits=bits, quantized_kv_start=start
    )
    next(steps)  # the prompt, prefilled
    tic = time.perf_counter()
    for _ in steps:
        pass
    return (count - 1) / (time.perf_counter() - tic)


def speed_lines(model, prompt: list, count: int) -> list:
    """The results file's speed table: each cache in turn, twice, the better run counting."""
    # (bits, quantized_kv_start): the last is main.py's default start (mlx-lm's), past this prompt
    kinds = [(bits, 0) for bits in WIDTHS] + [(8, 5000)]
    rates = {kind: 0.0 for kind in kinds}
    for _ in range(2):
        for bits, start in kinds:
            rates[bits, start] = max(rates[bits, start], speed(model, prompt, bits, count, start))
    lines = [
        "",
        f"## Speed: one row, {count} tokens after {len(prompt)}, best of 2",
        "",
        "| cache | tok/s | vs float32 |",
        "|---|---:|---:|",
    ]
    return lines + [
        f"| {name(bits)}{f' from token {start}' if start else ''} | {rates[bits, start]:.1f} | "
        f"{rates[bits, start] / rates[None, 0]:.2f}x |"
        for bits, start in kinds
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quality-tokens", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--long-rows", type=int, default=4)
    parser.add_argument("--long-context", type=int, default=8192)
    parser.add_argument("--single-context", type=int, default=16384)
    parser.add_argument(
        "--long-only", action="store_true", help=f"Only the memory at length, into {LONG.name}."
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model, tokenizer, _ = load_model(None)
    if args.long_only:
        write_long(model, args)
        return
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    words = tokenizer.encode("\n".join(page.read_text() for page in pages))
    text = words[: args.quality_tokens]
    prompts = [words[row * 97 : row * 97 + args.context] for row in range(args.rows)]
    lines = [
        "# KV cache quantization (#58)",
        "",
        f"`flock /tmp/bench.lock python -m benchmarks.kv_quantization --quality-tokens "
        f"{args.quality_tokens} --rows {args.rows} --context {args.context} --decode-tokens "
        f"{args.decode_tokens}`",
        "",
        f"{describe_backend()}, {platform.machine()}; embedded SmolLM2-135M-Instruct (float32 "
        "weights, 3 key/value heads of 64 dims in 30 layers); groups of 64 values per scale.",
        "",
        f"## Quality: {len(text)} tokens of the repo's docs",
        "",
        "| cache | perplexity | argmax agrees with float32 |",
        "|---|---:|---:|",
    ]
    reference = None
    for bits in WIDTHS:
        perplexity, argmaxes = quality(model, text, bits)
        reference = reference or argmaxes
        agree = sum(a == b for a, b in zip(argmaxes, reference)) / len(reference)
        lines.append(f"| {name(bits)} | {perplexity:.3f} | {agree:.2%} |")
        print(lines[-1], flush=True)
    lines += [
        "",
        f"## Memory: {args.rows} rows of {args.context} tokens in one batch",
        "",
        "| cache | bytes held | vs float32 | peak GB | mlx-lm one stream, bytes | vs float32 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    base = theirs_base = None
    for bits in WIDTHS:
        held, peak = memory(model, prompts, bits)
        theirs = mlx_lm_bytes(model, prompts[0], bits)
        base, theirs_base = base or held, theirs_base or theirs
        lines.append(
            f"| {name(bits)} | {held / 1e6:.1f} MB | {held / base:.3f}x | {peak:.3f} | "
            f"{theirs / 1e6:.1f} MB | {theirs / theirs_base:.3f}x |"
        )
        print(lines[-1], flush=True)
    lines += speed_lines(model, prompts[0], args.decode_tokens)
    print("\n".join(lines[-4:]), flush=True)
    Path(args.out or RESULTS).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out or RESULTS}")


if __name__ == "__main__":
    main()
