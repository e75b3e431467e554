"""The disk tier of the prompt cache: a model's caches of prompt prefixes in blocks of
``block_tokens`` tokens, each under a chained hash of every token up to its end and of the
model's identity (``identity.py``), so a prompt that extends a stored prefix restores its longest
run of stored blocks and prefills only the rest.

    store = PromptStore("~/.cache/mlx-decoding/prompts", model)
    generate(model, tokenizer, prompt, prompt_store=store)  # restores, prefills, stores blocks
    store.close()                                            # waits for the writes

What a block holds, for the positions ``[start, end)`` of its tokens: each full attention layer's
keys and values there; each sliding layer's from ``end - window + 1`` on (what a query at ``end``
can see); a head's features (``ExtraRows``) like a full layer; recurrent states as they are at
``end``. A prefill stops at every block boundary of a model with windows or recurrent layers to
capture them (``decoder.prefill.Prefill``); a full-attention model's blocks are cut from whatever
cache holds them, a finished row's included. A block is written only when it holds all of that,
so any run of stored blocks from the first one restores exactly.
"""

import hashlib
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx

from decoder.cache import Cache, CachedPrefix, architecture, make_cache
from decoder.layer_caches import KVRows
from decoder.prefill import PrefixStore

from .block_store import BlockStore, chain_keys
from .identity import model_identity

FORMAT = "1"  # of a block's arrays and metadata; a new format starts a new chain of keys
# Tokens per block: a prompt that diverges inside a block prefills it again, and each block is a
# file written, read and hashed apart (benchmarks/results/prompt_store.md measures the choice).
BLOCK_TOKENS = 256


class PromptStore(PrefixStore):
    """Blocks of a model's prompt caches in ``directory`` (``BlockStore``: written by a thread,
    least recently used out past ``max_bytes``, shared with other models and processes).

    Args:
        shard: how this process's model is cut from the checkpoint (a sharded rank's rank, size
            and kind), so ranks and shardings never read each other's blocks.
        agree: sharded, the fewest blocks any rank restores (``distributed.Session.fewest``):
            ranks in lockstep must all prefill the same tokens.
    """

    def __init__(
        self,
        directory,
        model,
        max_bytes: int = 10 * 2**30,
        block_tokens: int = BLOCK_TOKENS,
        shard: str = "",
        agree: Callable[[int], int] = lambda count: count,
    ):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
        cache = make_cache(model)
        if not all(isinstance(layer, KVRows) for layer in cache.attention):
            raise ValueError(
                f"{architecture(model)}: its attention in chunks cannot be stored in blocks yet"
            )
        self.windows = [layer.window for layer in cache.attention]
        self.num_states = len(cache.recurrent)
        self.num_extra = len(cache.extra)
        self.block_tokens = block_tokens
        self.each_block = bool(self.num_states) or any(w is not None for w in self.windows)
        layout = f"{self.windows} states {self.num_states} extra {self.num_extra}"
        self.identity = hashlib.sha256(
            f"format {FORMAT}; model {model_identity(model)}; cache {layout}; "
            f"block {block_tokens}; shard {shard}".encode()
        ).hexdigest()
        self.blocks = BlockStore(Path(directory).expanduser(), max_bytes)
        self.agree = agree
        self.restored_tokens = 0  # over every lookup, for reports

    def lookup(self, prompt: Sequence[int], held: int = 0) -> Optional[CachedPrefix]:
        """The cache of the longest run of stored blocks that ``prompt[:-1]`` starts with (its
        last token is the loop's first input), if longer than ``held`` tokens; else None."""
        keys = chain_keys(self.identity, list(prompt[:-1]), self.block_tokens)
        count = 0
        while count < len(keys) and self.blocks.has(keys[count]):
            count += 1
        loaded = []
        for key in keys[: count if count * self.block_tokens > held else 0]:
            block = self.blocks.get(key)
            if block is None:  # a bad block, or one another process evicted just now
                break
            loaded.append(block)
        loaded = loaded[: self.agree(len(loaded))]
        if len(loaded) * self.block_tokens <= held:
            return None
        prefix = self._joined(loaded)
        self.restored_tokens += prefix.length
        return prefix

    def _joined(self, blocks: list) -> CachedPrefix:
        """The ``CachedPrefix`` of a run of blocks from the first."""
        end = len(blocks) * self.block_tokens
        attention = [
            _entries(blocks, f"a{i}", end - window + 1 if window else 0)
            for i, window in enumerate(self.windows)
        ]
        extra = tuple(
            _entries(blocks, f"x{i}", 0) if all(f"x{i}.k" in b[0] for b in blocks) else None
            for i in range(self.num_extra)
        )
        arrays, metadata = blocks[-1]
        states = [
            [arrays[f"s{i}.{j}"] for j in range(int(metadata[f"s{i}"]))]
            for i in range(self.num_states)
        ]
        shortest = max(
            [first + w - 1 for (_, _, first), w in zip(attention, self.windows) if w and first > 0]
            + [0]
        )
        return CachedPrefix(end, attention, states, shortest, extra)

    def capture(self, tokens: Sequence[int], cache: Cache, row: int):
        """Store the blocks of ``tokens`` that row ``row`` of ``cache`` (holding them) completes."""
        todo = self._unstored(tokens)
        if todo:
            self.add(tokens, cache.extract(row, len(tokens), since=todo[0][0] * self.block_tokens))

    def add(self, tokens: Sequence[int], prefix: CachedPrefix):
        """Store the blocks of ``tokens`` not stored yet whose every layer ``prefix`` (the cache of
        ``tokens[:prefix.length]``, or of its positions from some block on) holds in full."""
        tokens = list(tokens[: prefix.length])
        for index, key in self._unstored(tokens):
            block = self._block(index, prefix)
            if block is not None:
                self.blocks.put(key, *block)

    def _unstored(self, tokens: list) -> list:
        """``(index, key)`` of each whole block of ``tokens`` the store lacks."""
        keys = chain_keys(self.identity, tokens, self.block_tokens)
        if self.num_states:  # states are known only at the end: only a block ending there
            keys = keys[-1:] if len(tokens) % self.block_tokens == 0 else []
            first = len(tokens) // self.block_tokens - len(keys)
        else:
            first = 0
        return [(first + i, key) for i, key in enumerate(keys) if not self.blocks.has(key)]

    def _block(self, index: int, prefix: CachedPrefix) -> Optional[tuple]:
        """Block ``index``'s ``(arrays, metadata)`` cut from ``prefix``, or None where it lacks
        some of them."""
        start, end = index * self.block_tokens, (index + 1) * self.block_tokens
        arrays, metadata = {}, {"block": str(index)}
        entries = [
            (f"a{i}", entry, w) for i, (entry, w) in enumerate(zip(prefix.attention, self.windows))
        ]
        entries += [
            (f"x{i}", entry, None) for i, entry in enumerate(prefix.extra) if entry is not None
        ]
        for name, (keys, values, first), window in entries:
            need = max(start, end - window + 1) if window else start
            if first > need or first + keys.shape[2] < end:
                if name.startswith("x"):  # a head's features are optional: its drafts wait
                    continue
                return None
            arrays[f"{name}.k"] = keys[:, :, need - first : end - first]
            arrays[f"{name}.v"] = values[:, :, need - first : end - first]
            metadata[f"{name}.first"] = str(need)
        if self.num_states:
            if prefix.length != end:
                return None
            for i, states in enumerate(prefix.states):
                metadata[f"s{i}"] = str(len(states))
                arrays.update({f"s{i}.{j}": state for j, state in enumerate(states)})
        return arrays, metadata

    def stats(self) -> dict:
        return {**self.blocks.stats(), "restored_tokens": self.restored_tokens}

    def close(self):
        self.blocks.close()


def _entries(blocks: list, name: str, since: int) -> tuple:
    """``(keys, values, first)`` of layer ``name`` over a run of blocks, from position ``since``
    (or the first block's start) on."""
    keys, values, first = [], [], None
    for arrays, metadata in blocks:
        block_first = int(metadata[f"{name}.first"])
        k, v = arrays[f"{name}.k"], arrays[f"{name}.v"]
        end = block_first + k.shape[2]
        if end <= since:
            continue
        skip = max(since - block_first, 0)
        keys.append(k[:, :, skip:])
        values.append(v[:, :, skip:])
        first = block_first + skip if first is None else first
    return mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2), first
