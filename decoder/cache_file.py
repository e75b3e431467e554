"""``load_cache``: a ``Cache`` that mlx-lm's ``save_prompt_cache`` wrote, read back with the kinds
here (mlx-lm's loader knows only its own classes)."""

import mlx.core as mx
import mlx_lm.models.cache as mlx_lm_cache
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import CacheList

from .cache import Cache, layers_of
from .layer_caches import ChunkedRows, KVRows, StateRows


def _kinds() -> dict:
    """The kinds here and their subclasses (such as a wrapper's ``ExtraRows``), by class name."""
    found, kinds = [KVRows, StateRows, ChunkedRows], {}
    while found:
        kind = found.pop()
        kinds[kind.__name__] = kind
        found += kind.__subclasses__()
    return kinds


def _from_state(class_name: str, state, kinds: dict):
    """A layer of class ``class_name`` (one of ``kinds``, else mlx-lm's) from its ``state``."""
    if class_name == "CacheList":  # its children are named the same way
        return CacheList(*(_from_state(child, s, kinds) for s, child in state))
    return (kinds.get(class_name) or getattr(mlx_lm_cache, class_name)).from_state(state)


def load_cache(file_name: str) -> Cache:
    """The cache ``save_prompt_cache(file_name, cache.layers)`` saved (mlx-lm's loader cannot find
    the kinds here), to pass as ``prompt_cache=``."""
    arrays, metadata = mx.load(file_name, return_metadata=True)
    _, class_names, scalars = tree_unflatten(list(metadata.items()))
    decode = {
        "scalar": lambda array: array.item(),
        "string": lambda array: "".join(chr(code) for code in array.tolist()),
        "none": lambda array: None,
    }
    for key, kind in scalars[1:]:  # the first is a placeholder (see save_prompt_cache)
        arrays[key] = decode[kind](arrays[key])
    states = tree_unflatten(list(arrays.items()))
    kinds = _kinds()
    layers = [_from_state(name, state, kinds) for name, state in zip(class_names, states)]
    return Cache(layers, layers_of(layers)[0].rows)
