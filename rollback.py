"""Take a model's cache back to the tokens a verify pass accepted, for every kind of layer mlx-lm builds.

A pass writes ``pending + draft`` into the cache and the target keeps a prefix of the draft. How each
kind of layer forgets the rest:

- Attention layers (``KVCache`` and its kin) drop the rejected tail by moving an offset (``trim``).
- Sliding-window layers: mlx-lm's ``RotatingKVCache`` writes over its oldest slot once it is full,
  and then cannot be trimmed (``trim_prompt_cache`` returns 0 without raising). ``SlidingKVCache``
  keeps the window plus some slack instead, drops old slots a block at a time, and masks what lies
  outside each query's window, so a draft rolls back at any length.
- Recurrent layers (``ArraysCache``: Mamba's conv and SSM states, gated delta) hold one state, not an
  entry per token. ``checkpoint`` keeps the state from before a pass (references, no copy: the
  layers replace their arrays rather than write into them) and ``rewind`` goes back to it when a
  draft token was rejected; the tokens the pass accepted are then fed again at the front of the
  next pass, where they cost width rather than a pass of their own.

    cache = make_cache(model)       # the model's own cache kinds, sliding ones made trimmable
    rollback = Rollback(cache)      # refuses a kind it cannot roll back, in one line
    rollback.checkpoint()           # before a pass with a draft
    kept = rollback.rewind(num_rejected, pass_width)  # False: feed the pass's accepted tokens again
"""

from typing import Optional

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import CacheList, RotatingKVCache, _BaseCache, make_prompt_cache


class CacheKindError(ValueError):
    """A layer cache that drafts cannot be rolled back in (the message names it)."""


class SlidingKVCache(_BaseCache):
    """Keys and values of a sliding-window attention layer that can drop its last tokens at any length.

    Holds absolute positions ``[start, offset)``: at least the window and ``step`` positions more,
    so that a rollback of up to ``step`` tokens still finds every key its queries see. Old slots
    are dropped ``step`` at a time (one copy of about ``window + step`` slots per ``step`` tokens).
    Attention gets only the keys some query of the call can see, ``[offset - window + 1, offset + N)``,
    masked to each query's own window.
    """

    step = 256

    def __init__(self, window: int):
        self.window = window
        self.keys = self.values = None
        self.offset = 0  # the absolute position of the next token (RoPE reads it)
        self.start = 0  # the absolute position of the first stored slot

    def _first_seen(self) -> int:
        """The oldest position a query of the next call can see."""
        return max(self.start, self.offset - self.window + 1)

    def _make_room(self, keys: mx.array, values: mx.array):
        keep_from = max(self.start, self.offset - self.window - self.step + 1)
        kept = self.offset - keep_from
        size = (kept + keys.shape[2] + 2 * self.step - 1) // self.step * self.step
        new_keys = mx.zeros((*keys.shape[:2], size, keys.shape[3]), keys.dtype)
        new_values = mx.zeros((*values.shape[:2], size, values.shape[3]), values.dtype)
        if kept:
            first = keep_from - self.start
            new_keys[..., :kept, :] = self.keys[..., first : first + kept, :]
            new_values[..., :kept, :] = self.values[..., first : first + kept, :]
        self.keys, self.values, self.start = new_keys, new_values, keep_from

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        first = self._first_seen()  # before any drop: the mask was made with it
        if self.keys is None or self.offset - self.start + keys.shape[2] > self.keys.shape[2]:
            self._make_room(keys, values)
        index = self.offset - self.start
        self.keys[..., index : index + keys.shape[2], :] = keys
        self.values[..., index : index + keys.shape[2], :] = values
        self.offset += keys.shape[2]
        end = self.offset - self.start
        return self.keys[..., first - self.start : end, :], self.values[..., first - self.start : end, :]

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False, **kwargs):
        # A query never sees more than the cache's window, however wide a window the model asks for
        # (plamo3 asks for one more): a one-token step sees only that many, and a verify pass must see
        # what one-token steps would.
        window = min(window_size or self.window, self.window)
        if N == 1 and window == self.window and not return_array:
            return None  # one query sees every key it is given
        first = self._first_seen()
        return create_causal_mask(N, self.offset - first, window_size=window)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        # The slack keeps `step` positions under the window: a longer rollback would lose keys.
        n = min(n, self.offset - self.start, self.step)
        self.offset -= n
        return n

    def size(self) -> int:
        return min(self.offset, self.window)

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.start, self.window

    @state.setter
    def state(self, value):
        self.keys, self.values, self.offset, self.start, self.window = value

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def _sliding(rotating: RotatingKVCache) -> SlidingKVCache:
    if rotating.keep:
        raise CacheKindError(f"a sliding-window cache that always keeps its first {rotating.keep} tokens "
                             "cannot be rolled back yet")
    if not rotating.empty():
        raise CacheKindError("a RotatingKVCache that already holds tokens cannot be rolled back; "
                             "build the prompt cache with rollback.make_cache(model)")
    return SlidingKVCache(rotating.max_size)


def convert(layer):
    """``layer`` (one entry of mlx-lm's cache) in a form a draft can be rolled back in."""
    if isinstance(layer, RotatingKVCache):  # mlx-lm's kinds are told apart by class: a renaming table
        return _sliding(layer)
    if isinstance(layer, CacheList):
        return CacheList(*(convert(child) for child in layer.caches))
    return layer


def architecture(model) -> str:
    """The model's ``model_type`` (mlx-lm's name for its architecture), to name it in a refusal."""
    return getattr(getattr(model, "args", None), "model_type", None) or type(model).__name__


def make_cache(model) -> list:
    """The model's cache (``make_prompt_cache``), every layer in a kind ``Rollback`` can roll back;
    ``CacheKindError`` naming the architecture and the layer kind otherwise."""
    try:
        cache = [convert(layer) for layer in make_prompt_cache(model)]
        Rollback(cache)  # refuse now, before any work, a kind that cannot be rolled back
    except CacheKindError as error:
        raise CacheKindError(f"{architecture(model)}: {error}") from None
    return cache


def layers_of(cache: list) -> list:
    """Every layer cache, with the children of a ``CacheList`` in its place."""
    return [leaf for layer in cache for leaf in (layers_of(layer.caches) if isinstance(layer, CacheList) else [layer])]


def is_recurrent(layer) -> bool:
    """A layer that keeps one state rather than an entry per token (mlx-lm's ArraysCache and kin)."""
    return not layer.is_trimmable() and isinstance(getattr(layer, "cache", None), list)


class Rollback:
    """Rolls ``cache`` back after each verify pass: trims its attention layers and, for recurrent
    layers, restores the state kept by ``checkpoint``. Refuses (``CacheKindError``) a layer that is
    neither, or a rotating one that ``convert`` has not replaced."""

    def __init__(self, cache: list):
        layers = layers_of(cache)
        for layer in layers:
            if isinstance(layer, RotatingKVCache):
                raise CacheKindError("a RotatingKVCache cannot be rolled back once full; build the cache with "
                                     "rollback.make_cache(model)")
            if not isinstance(layer, _BaseCache) or not (layer.is_trimmable() or is_recurrent(layer)):
                raise CacheKindError(f"its {type(layer).__name__} layers can neither be trimmed nor restored")
        self.trimmable = [layer for layer in layers if layer.is_trimmable()]
        self.recurrent = [layer for layer in layers if not layer.is_trimmable()]
        self.saved = None

    def offset(self) -> Optional[int]:
        """How many tokens the cache holds (None for a model of recurrent layers only: no layer counts)."""
        return self.trimmable[0].offset if self.trimmable else None

    def checkpoint(self):
        """Keep the recurrent layers' states as they are now, before a pass with a draft."""
        # tree_map copies the lists that hold the arrays, so a layer assigning a new state leaves these.
        self.saved = [tree_map(lambda x: x, layer.state) for layer in self.recurrent]

    def rewind(self, num_rejected: int, pass_width: int) -> bool:
        """Forget the ``num_rejected`` last tokens of a ``pass_width``-token pass. Returns True when
        the cache now holds the rest; False when it went back to before the pass (recurrent layers),
        and the pass's accepted tokens must be fed again."""
        if num_rejected == 0:
            return True
        restore = bool(self.recurrent)
        count = pass_width if restore else num_rejected
        for layer in self.trimmable:
            if layer.trim(count) != count:  # a count that says less was done is never ignored
                raise RuntimeError(f"the {type(layer).__name__} could not drop its last {count} tokens")
        if restore:
            for layer, state in zip(self.recurrent, self.saved):
                layer.state = state
        return not restore
