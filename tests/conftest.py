import os
import sys
from pathlib import Path

import pytest

from loading import fast_blas

# pytest-xdist's workers (make test) share the cores: one BLAS thread each, or their spinning
# threads thrash (a count the user set is kept). They start with tests/without_torch on their
# path, as the tests' other processes do; a worker is the test process, where torch is an oracle.
if os.environ.get("PYTEST_XDIST_WORKER"):
    if not any(map(os.environ.get, fast_blas.THREAD_VARIABLES)):
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
    if "torch" in sys.modules and sys.modules["torch"] is None:
        del sys.modules["torch"]
fast_blas.load()  # before any test module imports mlx.core

# The processes the tests start (main.py, the server, ranks) run without torch, as a user's do.
_WITHOUT_TORCH = str(Path(__file__).parent / "without_torch")
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [_WITHOUT_TORCH, os.environ.get("PYTHONPATH")])
)


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct (converted into the cache on first use)."""
    from loading.load import load_model

    return load_model()


@pytest.fixture(scope="session")
def chat_prompt(embedded):
    def encode(text):
        _, tokenizer, _ = embedded
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )

    return encode


@pytest.fixture(scope="session")
def self_draft(embedded, tmp_path_factory):
    """The embedded model's first 24 layers, as a draft model directory (accepts some drafts)."""
    from loading.conversion import convert
    from loading.load import embedded_gguf

    return convert(
        str(tmp_path_factory.mktemp("draft") / "draft"), gguf=str(embedded_gguf()), num_layers=24
    )
