import os
from pathlib import Path

import pytest

from loading import fast_blas

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
