"""Decode several CLI cases on a sharded target; run by tests/test_distributed.py.

    mlx.launch -n 3 python tests/distributed_worker.py '[["--prompt", "Hi", "--max-tokens", "8"]]'

Each case goes through main.py's own ``build_run`` (loading, sharding, draft
sources); rank 0 prints one JSON line per case. Without a launcher it is the
one-process reference.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

import distributed  # noqa: E402
import main  # noqa: E402
from decoder import generate  # noqa: E402


def run_cases(cases, session=None):
    """Yields ``{"argv", "tokens", "passes", "mode"}`` for each argv list in ``cases``."""
    for argv in cases:
        args = main.build_parser().parse_args(argv)
        mx.random.seed(args.seed)
        model, tokenizer, prompt, kwargs = main.build_run(args, session)
        with distributed.reporting_faults():
            result = generate(model, tokenizer, prompt, **kwargs)
        yield {"argv": argv, "tokens": result.tokens, "passes": result.stats.target_forward_passes,
               "mode": getattr(model, "mode", "single")}


if __name__ == "__main__":
    try:
        session = distributed.start(timeout=60)
        for record in run_cases(json.loads(sys.argv[1]), session):
            print(json.dumps(record), flush=True)
    except distributed.DistributedError as error:
        sys.stderr.write(f"error: {error}\n")
        sys.exit(1)
