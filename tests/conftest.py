import pytest

import fast_blas

fast_blas.load()  # before any test module imports mlx.core



@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct (converted into the cache on first use)."""
    from loading import load_model

    return load_model()


@pytest.fixture(scope="session")
def chat_prompt(embedded):
    def encode(text):
        _, tokenizer, _ = embedded
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)

    return encode
