"""A model's identity for the prompt store: what it computes, not where it was loaded from."""

import hashlib

import mlx.core as mx
from mlx.utils import tree_flatten

SAMPLES = 4096  # values read from each weight: two fine-tunes of one model differ in every tensor


def model_identity(model) -> str:
    """A hex digest of the model's configuration and of each weight's name, shape, dtype and
    ``SAMPLES`` values spread over it. A copy of the same weights anywhere gives the same digest;
    another checkpoint, dtype, quantization or shard a different one. Reading the samples costs
    one gather per weight, not a pass over every byte (a lazily loaded rank reads a page each)."""
    digest = hashlib.sha256(repr(getattr(model, "args", type(model).__name__)).encode())
    for name, weight in tree_flatten(model.parameters()):
        digest.update(f"{name} {weight.shape} {weight.dtype}".encode())
        flat = weight.reshape(-1)
        step = max(flat.size // SAMPLES, 1)
        sample = flat[::step][:SAMPLES]
        if sample.dtype == mx.bfloat16:  # numpy has no bfloat16: hash its bits
            sample = sample.view(mx.uint16)
        digest.update(memoryview(mx.contiguous(sample)).tobytes())
    return digest.hexdigest()
