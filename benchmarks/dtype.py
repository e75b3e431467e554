"""Which dtype decodes the embedded model fastest on this backend?

    python -m benchmarks.dtype

Converts the embedded GGUF at each dtype (and 4-bit) into the cache and times
plain greedy decoding of the same prompts, interleaved, in one process.
"""

import datetime

import mlx.core as mx
from mlx_lm import load

from benchmarks.harness import Method, load_prompts, markdown_table, side_by_side
from conversion import convert
from loading import cache_dir, describe_backend, embedded_gguf

VARIANTS = {"float32": {}, "float16": {}, "bfloat16": {}, "4-bit (float16 scales)": {"quantize": True}}


def variant_path(name, options):
    dtype = "float16" if options else name
    path = cache_dir() / "models" / f"SmolLM2-135M-Instruct-{dtype}{'-q4' if options else ''}"
    if not path.exists():
        convert(str(path), gguf=str(embedded_gguf()), dtype=dtype, **options)
    return path


def main():
    models = {name: load(str(variant_path(name, options))) for name, options in VARIANTS.items()}
    tokenizer = models["float32"][1]
    # One prompt, 32 tokens: MLX's 4-bit CPU kernels run at ~0.2 tok/s here, so more takes too long.
    prompts = {"open_ended": load_prompts(tokenizer, ["open_ended"])["open_ended"][:1]}
    # Each method runs a different model: a custom runner over our own loop.
    from decoder import eos_ids_of, generate_step

    def runner(model):
        def run(prompt, max_tokens):
            for token, _ in generate_step(prompt, model, max_tokens=max_tokens, eos_token_ids=eos_ids_of(tokenizer)):
                yield token
        return run

    methods = [Method(name, run=runner(model), greedy=False) for name, (model, _) in models.items()]
    first_prompt = prompts["open_ended"][0][1]
    for method in methods:  # a short warm-up of each (a full one would take minutes at 4 bits)
        list(method.run(first_prompt, 4))
    results = side_by_side(None, tokenizer, prompts, methods, max_tokens=32, warmup=False)
    print(f"{datetime.date.today()} · {describe_backend()} · mlx {mx.__version__} · plain greedy, 32 new tokens")
    print(markdown_table(results, "float32"))


if __name__ == "__main__":
    main()
