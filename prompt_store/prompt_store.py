"""The disk tier of the prompt cache: a model's caches of prompt prefixes in blocks of
``block_tokens`` tokens, each under a chained hash of every token up to its end and of the
model's identity (``identity.py``), so a prompt that extends a stored prefix restores its longest
run of stored blocks and prefills only the rest.

    store = PromptStore("~/.cache/mlx-decoding/prompts", model)
    generate(model, tokenizer, prompt, prompt_store=store)  # restores, prefills, stores blocks
    store.close()                                            # waits for the writes

Two kinds of entry, so that each is written once, complete:
- a **block** holds its tokens and, for its positions, each full attention layer's keys and
  values and a head's features (``ExtraRows``): any cache that holds the block has them all;
- a **boundary** holds what exists only at a block's end: each sliding layer's window there (the
  keys a query at the end can see) and the recurrent states. A prefill stops at each block
  boundary to capture them (``decoder.prefill.Prefill``), a finished row where it holds them.
A prompt restores the longest run of blocks from the first that ends at a stored boundary (any
run, for a model of full attention only).
"""

import hashlib
from functools import partial
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx

from decoder.cache import Cache, CachedPrefix, architecture, make_cache
from decoder.layer_caches import KVRows, parts_of
from decoder.prefill import PrefixStore

from .block_store import BlockStore, chain_keys
from .identity import model_identity

FORMAT = "1"  # of a block's arrays and metadata; a new format starts a new chain of keys
# Tokens per block: a prompt that diverges inside a block prefills it again, and each block is a
# file written, read and hashed apart (benchmarks/results/prompt_store.md measures the choice).
BLOCK_TOKENS = 128


class PromptStore(PrefixStore):
    """Blocks of a model's prompt caches in ``directory`` (``BlockStore``: written by a thread,
    least recently used out past ``max_bytes``, shared with other models and processes).

    Args:
        shard: how this process's model is cut from the checkpoint (a sharded rank's rank, size
            and kind), so ranks and shardings never read each other's blocks.
        agree: sharded, the fewest blocks any rank restores (``distributed.Session.fewest``):
            ranks in lockstep must all prefill the same tokens.
        kv_bits, kv_group_size, quantized_kv_start: the cache's quantization (``make_cache``);
            its blocks are kept as the cache held them, apart from any other width's.
    """

    def __init__(
        self,
        directory,
        model,
        max_bytes: int = 10 * 2**30,
        block_tokens: int = BLOCK_TOKENS,
        shard: str = "",
        agree: Callable[[int], int] = lambda count: count,
        kv_bits: Optional[int] = None,
        kv_group_size: int = 64,
        quantized_kv_start: int = 0,
    ):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
        cache = make_cache(model, kv_bits=kv_bits, kv_group_size=kv_group_size)
        if not all(isinstance(layer, KVRows) for layer in cache.attention):
            raise ValueError(
                f"{architecture(model)}: its attention in chunks cannot be stored in blocks yet"
            )
        self.windows = [layer.window for layer in cache.attention]
        self.num_states = len(cache.recurrent)
        self.num_extra = len(cache.extra)
        self.block_tokens = block_tokens
        # windows or states: a run of blocks restores only up to a stored boundary, and a
        # prefill stops at each one to store it
        self.each_block = bool(self.num_states) or any(w is not None for w in self.windows)
        layout = f"{self.windows} states {self.num_states} extra {self.num_extra} bits {kv_bits}"
        layout += f" group {kv_group_size} from {quantized_kv_start}" if kv_bits else ""
        self.identity = hashlib.sha256(
            f"format {FORMAT}; model {model_identity(model)}; cache {layout}; "
            f"block {block_tokens}; shard {shard}".encode()
        ).hexdigest()
        self.blocks = BlockStore(Path(directory).expanduser(), max_bytes)
        self._quantize = partial(mx.quantize, group_size=kv_group_size, bits=kv_bits)
        self.agree = agree
        self.restored_tokens = 0  # over every lookup, for reports

    def lookup(self, prompt: Sequence[int], held: int = 0) -> Optional[CachedPrefix]:
        """The cache of the longest restorable run of blocks that ``prompt[:-1]`` starts with (its
        last token is the loop's first input), if longer than ``held`` tokens; else None."""
        keys = chain_keys(self.identity, list(prompt[:-1]), self.block_tokens)
        count = 0
        while count < len(keys) and self.blocks.has(keys[count]):
            count += 1
        if self.each_block:  # the run must end where its windows and states were kept
            while count and not self.blocks.has(_boundary(keys[count - 1])):
                count -= 1
        loaded = []
        for key in keys[: count if count * self.block_tokens > held else 0]:
            block = self.blocks.get(key)
            if block is None:  # a bad block, or one another process evicted just now
                break
            loaded.append(block)
        count = self.agree(len(loaded))  # sharded: every rank restores as many as the fewest
        loaded, boundary = loaded[:count], None
        if self.each_block:  # agreed on, again: a boundary may be missing where the run ends
            boundary = self.blocks.get(_boundary(keys[count - 1])) if count else None
            loaded = loaded[: self.agree(count if boundary is not None else 0)]
        if len(loaded) * self.block_tokens <= held:
            return None
        prefix = self._joined(loaded, boundary)
        self.restored_tokens += prefix.length
        return prefix

    def _joined(self, blocks: list, boundary: Optional[tuple]) -> CachedPrefix:
        """The ``CachedPrefix`` of a run of blocks from the first, ending at ``boundary``."""
        end = len(blocks) * self.block_tokens
        attention = [
            _entry(boundary if window else blocks, f"a{i}", self._quantize)
            for i, window in enumerate(self.windows)
        ]
        extra = tuple(
            _entry(blocks, f"x{i}") if all(f"x{i}.k0" in b[0] for b in blocks) else None
            for i in range(self.num_extra)
        )
        states = []
        if self.num_states:
            arrays, metadata = boundary
            states = [
                [arrays[f"s{i}.{j}"] for j in range(int(metadata[f"s{i}"]))]
                for i in range(self.num_states)
            ]
        shortest = max(
            [first + w - 1 for (_, _, first), w in zip(attention, self.windows) if w and first]
            + [0]
        )
        return CachedPrefix(end, attention, states, shortest, extra)

    def capture(self, tokens: Sequence[int], cache: Cache, row: int):
        """Store what row ``row`` of ``cache``, holding ``tokens``, adds: the blocks it completes,
        and the boundary at its end."""
        keys = chain_keys(self.identity, list(tokens), self.block_tokens)
        todo = [index for index, key in enumerate(keys) if not self.blocks.has(key)]
        since = todo[0] * self.block_tokens if todo else len(keys) * self.block_tokens
        widest = max((window for window in self.windows if window), default=1)
        since = max(min(since, len(tokens) - widest + 1), 0)  # a window reaches back from the end
        self.add(tokens, cache.extract(row, len(tokens), since))

    def add(self, tokens: Sequence[int], prefix: CachedPrefix):
        """Store the blocks of ``tokens`` not stored yet that ``prefix`` (the cache of
        ``tokens[:prefix.length]``, or of its positions from some block on) holds, and the
        boundary at its end if it ends on one."""
        tokens = list(tokens[: prefix.length])
        keys = chain_keys(self.identity, tokens, self.block_tokens)
        for index, key in enumerate(keys):
            if not self.blocks.has(key):
                block = self._block(index, tokens, prefix)
                if block is not None:
                    self.blocks.put(key, *block)
        if self.each_block and keys and len(tokens) % self.block_tokens == 0:
            boundary = _boundary(keys[-1])
            if not self.blocks.has(boundary):
                entry = self._boundary(prefix)
                if entry is not None:
                    self.blocks.put(boundary, *entry)

    def _block(self, index: int, tokens: list, prefix: CachedPrefix) -> Optional[tuple]:
        """Block ``index``'s ``(arrays, metadata)`` cut from ``prefix``, or None where it lacks
        some of its full attention layers' positions."""
        start, end = index * self.block_tokens, (index + 1) * self.block_tokens
        arrays = {"tokens": mx.array(tokens[start:end], mx.int32)}
        full = [
            (f"a{i}", e) for i, (e, w) in enumerate(zip(prefix.attention, self.windows)) if not w
        ]
        for name, entry in full:
            if not _cut(entry, start, end, name, arrays):
                return None
        for i, entry in enumerate(prefix.extra):  # a head's features: its drafts wait without
            if entry is not None:
                _cut(entry, start, end, f"x{i}", arrays)
        return arrays, {"block": str(index)}

    def _boundary(self, prefix: CachedPrefix) -> Optional[tuple]:
        """The windows and states at the end of ``prefix``, or None where it lacks a window."""
        end, arrays, metadata = prefix.length, {}, {"end": str(prefix.length)}
        for i, (entry, window) in enumerate(zip(prefix.attention, self.windows)):
            if window and not _cut(entry, max(end - window + 1, 0), end, f"a{i}", arrays):
                return None
        for i, states in enumerate(prefix.states):
            metadata[f"s{i}"] = str(len(states))
            arrays.update({f"s{i}.{j}": state for j, state in enumerate(states)})
        return arrays, metadata

    def stats(self) -> dict:
        return {**self.blocks.stats(), "restored_tokens": self.restored_tokens}

    def close(self):
        """Wait for the queued writes (a process that exits first loses them)."""
        self.blocks.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def _boundary(key: str) -> str:
    """The key of the boundary entry at the end of block ``key``."""
    return hashlib.sha256(f"{key} boundary".encode()).hexdigest()


def _cut(entry: tuple, start: int, end: int, name: str, arrays: dict) -> bool:
    """Put positions ``[start, end)`` of an attention ``entry`` (keys, values, first position) in
    ``arrays`` as ``name``; False where the entry lacks some of them."""
    keys, values, first = entry
    if first > start or first + parts_of(keys)[0].shape[2] < end:
        return False
    for kind, stored in (("k", keys), ("v", values)):  # a quantized layer's parts one by one
        for index, part in enumerate(parts_of(stored)):
            arrays[f"{name}.{kind}{index}"] = part[:, :, start - first : end - first]
    arrays[f"{name}.first"] = mx.array(start, mx.int32)
    return True


def _entry(entries, name: str, quantize: Optional[Callable] = None) -> tuple:
    """``(keys, values, first)`` of layer ``name``: a boundary's, or a run of blocks' joined
    (blocks stored before ``quantized_kv_start`` are ``quantize``d where later ones are)."""
    runs = [entries] if isinstance(entries, tuple) else entries

    def joined(kind: str):
        each = []
        for arrays, _ in runs:
            count = sum(key.startswith(f"{name}.{kind}") for key in arrays)
            each.append([arrays[f"{name}.{kind}{index}"] for index in range(count)])
        if len({len(parts) for parts in each}) > 1:
            each = [parts if len(parts) > 1 else quantize(parts[0]) for parts in each]
        parts = [mx.concatenate(list(column), axis=2) for column in zip(*each)]
        return parts[0] if len(parts) == 1 else tuple(parts)

    return joined("k"), joined("v"), runs[0][0][f"{name}.first"].item()
