"""The server's prompt cache: finished rows' caches, kept for later prompts that extend them."""

from collections import OrderedDict

import mlx.core as mx
from mlx_lm.utils import common_prefix_len

from decoder.cache import CachedPrefix


class PromptCache:
    """The caches of finished sequences (``cache.CachedPrefix``), least recently used first out,
    at most ``max_bytes``. Attention entries serve any prefix of their tokens long enough for the
    keys a sliding layer kept; an entry with recurrent states only a prompt that extends all of its
    tokens."""

    def __init__(self, max_bytes: int, weigh=None):
        # tuple(tokens) -> (CachedPrefix, nbytes)
        self.max_bytes, self.entries = max_bytes, OrderedDict()
        # an entry's bytes -> the bytes it counts for (sharded: the largest rank's, server/ranks.py)
        self.weigh = weigh if weigh is not None else (lambda nbytes: nbytes)
        self.nbytes = 0  # of all entries
        self.hits, self.misses, self.restored_tokens = 0, 0, 0

    def add(self, tokens: list, prefix: CachedPrefix):
        tokens = tuple(tokens[: prefix.length])
        mx.eval(prefix.arrays())
        # prefixes of this one say nothing more (with states, they still might)
        if not prefix.states:
            for key in [
                k
                for k, (old, _) in self.entries.items()
                if tokens[: len(k)] == k and prefix.shortest <= old.shortest
            ]:
                self._drop(key)
        self.entries[tokens] = (prefix, self.weigh(sum(array.nbytes for array in prefix.arrays())))
        self.nbytes += self.entries[tokens][1]
        while self.entries and self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: tuple):
        self.nbytes -= self.entries.pop(key)[1]

    def lookup(self, prompt: list):
        """``(the cache of the longest cached prefix of prompt[:-1], its length)``, or (None, 0)."""
        best, length = None, 0
        for key, (prefix, _) in self.entries.items():
            common = common_prefix_len(list(key), prompt[:-1])
            usable = prefix.usable(common)
            if usable > length:
                best, length = key, usable
        if best is None:
            self.misses += 1
            return None, 0
        self.hits, self.restored_tokens = self.hits + 1, self.restored_tokens + length
        self.entries.move_to_end(best)
        return self.entries[best][0].cut(length), length

    def stats(self) -> dict:
        return {
            "entries": len(self.entries),
            "bytes": self.nbytes,
            "hits": self.hits,
            "misses": self.misses,
            "restored_tokens": self.restored_tokens,
        }
