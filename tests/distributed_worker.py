"""Decode several CLI cases on a sharded target; run by tests/test_distributed.py.

    mlx.launch -n 3 python tests/distributed_worker.py '[["--prompt", "Hi", "--max-tokens", "8"]]'

Each case goes through main.py's own ``build_run`` (loading, sharding, draft
sources); rank 0 prints one JSON line per case. Without a launcher it is the
one-process reference.
"""

import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from loading import fast_blas  # noqa: E402

fast_blas.load()  # before mlx.core, as main.py does

import mlx.core as mx  # noqa: E402

import distributed  # noqa: E402
import main  # noqa: E402
from decoder import generate  # noqa: E402
from decoder.pass_cost import PassCost  # noqa: E402


def run_cases(cases, session=None):
    """Yields ``{"argv", "tokens", "passes", "accepted", "mode", "blas_threads"}`` for each argv
    list in ``cases``."""
    for argv in cases:
        args = main.build_parser().parse_args(argv)
        main.validate(args)  # compiles --regex
        mx.random.seed(args.seed)
        model, tokenizer, prompt, kwargs = main.build_run(args, session)
        # Passes are compared step for step with one process, whose timings differ: decide from the
        # cost model's prior on both sides (a clock that stands still; main.py times its passes).
        kwargs["pass_cost"] = PassCost(clock=lambda: 0.0)
        with distributed.reporting_faults():
            result = generate(model, tokenizer, prompt, **kwargs)
        yield {
            "argv": argv,
            "tokens": result.tokens,
            "passes": result.stats.target_forward_passes,
            "accepted": result.stats.draft_accepted,
            "mode": getattr(model.model, "mode", "single"),
            "blas_threads": fast_blas.num_threads(),
        }


def tiny_logits_match(mode: str) -> dict:
    """Prefill and one decode pass of a tiny random Llama, sharded vs whole, on every rank."""
    from helpers import tiny_llama
    from mlx_lm.models.cache import make_prompt_cache

    from distributed.sharding import shard_model

    tokens = mx.array([[1, 2, 3, 4, 5, 6, 7]])
    whole, sharded = (
        tiny_llama(num_layers=5),
        shard_model(tiny_llama(num_layers=5), mx.distributed.init(), mode),
    )
    outputs = []
    for model in (whole, sharded):
        cache = make_prompt_cache(model)
        outputs.append([model(tokens[:, :5], cache=cache), model(tokens[:, 5:], cache=cache)])
    pairs = list(zip(*outputs))
    return {
        "rank": mx.distributed.init().rank(),
        "equal": all(mx.array_equal(a, b).item() for a, b in pairs),
        "max_diff": max(mx.abs(a - b).max().item() for a, b in pairs),
    }


if __name__ == "__main__":
    if sys.argv[1] == "--tiny":  # every rank prints
        print(json.dumps(tiny_logits_match(sys.argv[2])), flush=True)
        sys.exit()
    try:
        session = distributed.start(timeout=60, set_blas_threads=fast_blas.set_num_threads)
        for record in run_cases(json.loads(sys.argv[1]), session):
            print(json.dumps(record), flush=True)
    except distributed.DistributedError as error:
        sys.stderr.write(f"error: {error}\n")
        sys.exit(1)
