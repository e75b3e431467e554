"""Shard an mlx-lm target over the ranks of an ``mx.distributed`` group.

Sharding swaps the model's body (``model.model``: embedding, layers, final
norm) for a sharded one and leaves the rest of the mlx-lm model as it is, so
the decoder still runs a plain mlx-lm model (``model(inputs, cache=cache) ->
logits``, ``layers``, ``make_cache``, trimmable ``KVCache``s), and a draft
head's tap still reads the final hidden states from ``model.model``:

- tensor parallelism: mlx-lm's own ``model.shard(group)``; every rank holds 1/N
  of every layer and the layers all-reduce their partial products (two
  all-reduces per layer). Needs heads and MLP width divisible by N.
- pipeline parallelism: rank r holds a contiguous range of layers and passes
  the hidden state to rank r + 1 (one send per stage). Any layer count, any N;
  it computes exactly what one process computes.

Either way the body's output, the final hidden states, leaves one rank and is
broadcast to all (see ``broadcast``), and every rank applies the output head to
the same bits: its accept decisions see identical logits.
"""

from contextlib import contextmanager
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask

from decoder.layer_caches import each_part

MODES = ("auto", "tensor", "pipeline")


def broadcast(x: mx.array, root: int, group) -> mx.array:
    """``x`` from rank ``root`` on every rank, bit for bit.

    An all-sum where every other rank adds zeros: x + 0 == x exactly, so no
    rounding can creep in, whatever order the backend adds in.
    """
    if group.rank() != root:
        # Still evaluate x's graph: it holds this rank's sends and its share of the model's
        # all-reduces.
        x = mx.depends(mx.zeros_like(x), x)
    return mx.distributed.all_sum(x, group=group)


def has_body(model) -> bool:
    """A Llama-style layout: ``model.model`` with ``embed_tokens``, ``layers`` and ``norm``."""
    inner = getattr(model, "model", None)
    return all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm"))


def tensor_shardable(model, size: int) -> bool:
    """mlx-lm can split this model's heads and MLP evenly over ``size`` ranks."""
    args = getattr(model, "args", None)
    if not hasattr(model, "shard") or args is None or not has_body(model):
        return False
    widths = [
        getattr(args, name, None)
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size")
    ]
    return all(isinstance(width, int) and width % size == 0 for width in widths)


def choose_mode(model, size: int, mode: str = "auto") -> str:
    """``tensor`` where mlx-lm can shard the model evenly, else ``pipeline``.

    Raises ValueError (shown to the user) when the requested mode cannot work.
    """
    tensor_ok, body_ok = tensor_shardable(model, size), has_body(model)
    if not body_ok:
        raise ValueError(
            f"{type(model).__module__} has no Llama-style body (model.model with embed_tokens, "
            "layers and norm) to shard"
        )
    if mode == "auto":
        mode = "tensor" if tensor_ok else "pipeline"
    if mode == "tensor" and not tensor_ok:
        args = getattr(model, "args", None)
        heads = (
            getattr(args, "num_attention_heads", "?"),
            getattr(args, "num_key_value_heads", "?"),
        )
        raise ValueError(
            f"tensor sharding over {size} ranks needs a model with shard() whose "
            f"{heads[0]} query and {heads[1]} key/value heads divide by {size}; "
            "use --shard pipeline"
        )
    if mode == "pipeline" and size > len(model.model.layers):
        raise ValueError(f"{size} ranks but only {len(model.model.layers)} layers to pipeline")
    return mode


def layer_range(num_layers: int, rank: int, size: int) -> tuple:
    """Rank ``rank``'s contiguous ``[start, end)`` layers; the first ranks take the remainder."""
    base, extra = divmod(num_layers, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


class ShardedBody(nn.Module):
    """Stands in for an mlx-lm model's body: returns its final hidden states, the same on every
    rank.

    Args:
        body: the model's own body (``model.model``), already sharded.
        group: the ``mx.distributed`` group.
        heartbeat: called at each forward pass (the previous pass has finished by then).
    """

    mode = None
    exposes_layer_outputs = False  # only the final hidden states are made equal on every rank

    def __init__(self, body, group, heartbeat: Optional[Callable] = None):
        super().__init__()
        self.body = body
        self.group = group
        self.heartbeat = heartbeat

    # What mlx-lm's Model, make_cache and a draft head read from the body.
    @property
    def embed_tokens(self):
        return self.body.embed_tokens

    @property
    def norm(self):
        return self.body.norm

    @property
    def layers(self):
        return self.body.layers

    @property
    def sliding_window(self):
        return getattr(self.body, "sliding_window", None)


class TensorParallel(ShardedBody):
    """mlx-lm's ``shard()`` splits every layer; rank 0's hidden states go to everyone.

    Ring all-reduces give every rank the same sums (checked on this machine),
    but one broadcast makes agreement hold by construction, on any backend.
    """

    mode = "tensor"

    def __call__(self, inputs: mx.array, cache=None, input_embeddings=None) -> mx.array:
        if self.heartbeat:
            self.heartbeat()
        return broadcast(self.body(inputs, cache, input_embeddings), 0, self.group)


class Pipeline(ShardedBody):
    """Contiguous layer ranges per rank; the hidden state walks rank 0 -> 1 -> ... -> N-1.

    Every rank embeds the inputs (cheap, and it gives ``recv_like`` its shape);
    the last rank applies the final norm and broadcasts the result. Other ranks
    drop the layers they do not run, so with lazy loading their weights are never read.
    """

    mode = "pipeline"

    def __init__(self, body, group, heartbeat=None):
        super().__init__(body, group, heartbeat)
        self.rank, self.size = group.rank(), group.size()
        self.start, self.end = layer_range(len(body.layers), self.rank, self.size)
        body.layers = body.layers[self.start : self.end]

    def __call__(self, inputs: mx.array, cache=None, input_embeddings=None) -> mx.array:
        if self.heartbeat:
            self.heartbeat()
        body, group = self.body, self.group
        cache = cache if cache is not None else [None] * len(self.layers)
        h = input_embeddings if input_embeddings is not None else body.embed_tokens(inputs)
        # The full-attention mask comes from a full-attention layer's cache (as in mlx-lm's llama).
        full_cache = next(
            (c for layer, c in zip(self.layers, cache) if not getattr(layer, "use_sliding", False)),
            cache[0],
        )
        full_mask = create_attention_mask(h, full_cache)
        if self.rank > 0:
            h = mx.distributed.recv_like(h, self.rank - 1, group=group)
        for layer, layer_cache in zip(self.layers, cache):
            mask = full_mask
            if getattr(layer, "use_sliding", False):
                mask = create_attention_mask(h, layer_cache, window_size=self.sliding_window)
            h = layer(h, mask, cache=layer_cache)

        if self.rank == self.size - 1:
            h = body.norm(h)
        else:
            h = mx.distributed.send(h, self.rank + 1, group=group)
            # Prefill evaluates only the caches: make them wait for the send, or the next rank
            # hangs.
            if cache[-1] is not None:  # a quantized layer's keys are a tuple of arrays
                cache[-1].keys = each_part(lambda part: mx.depends(part, h), cache[-1].keys)
        return broadcast(h, self.size - 1, group)  # other ranks contribute zeros of the same shape


@contextmanager
def same_random_state():
    """Put the global PRNG key back afterwards.

    ``shard_linear`` initialises its new layers from the global key; without this,
    sampling after sharding would draw other numbers than one process with the same seed.
    """
    high, low = mx.random.state[0].tolist()
    yield
    mx.random.seed((high << 32) | low)  # seed(s) sets the key to (s >> 32, s & 0xffffffff)


def shard_model(model, group, mode: str = "auto", heartbeat: Optional[Callable] = None):
    """Shard a (lazily loaded) mlx-lm ``model`` over ``group`` in place and load this rank's
    weights.

    Returns ``model``, whose body (``model.model``) is now a ``TensorParallel`` or
    ``Pipeline`` and whose ``num_parameters`` is the whole model's size (a draft's
    cost model divides by it).

    Args:
        model: an mlx-lm model; load it with ``lazy=True`` so each rank reads only its shard.
        group: from ``mx.distributed.init()``.
        mode: ``auto`` (tensor where the shapes allow, else pipeline), ``tensor`` or ``pipeline``.
        heartbeat: called at each forward pass (for a watchdog).
    """
    mode = choose_mode(model, group.size(), mode)
    model.num_parameters = sum(value.size for _, value in tree_flatten(model.parameters()))
    with same_random_state():
        if mode == "tensor":
            model.shard(group)
        model.model = (TensorParallel if mode == "tensor" else Pipeline)(
            model.model, group, heartbeat
        )
    mx.eval(model.parameters())
    return model
