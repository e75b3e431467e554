"""Per-state token masks for regex-constrained decoding.

For a DFA state, `TokenIndex` gives which tokens may come next and the state each one leads to, so a
decoding step is one row lookup: `mx.where(index.allowed_mask(state), logits, -mx.inf)`. Rows are
built the first time generation reaches a state (one vectorized walk of the vocabulary) and kept in
a bounded LRU cache, so memory and time to first token do not grow with the states never visited.
Tokens are handled as raw bytes, so a token that ends halfway through a UTF-8 character is allowed
exactly when the regex allows that character.
"""

import hashlib
import json
import os
import re
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer

from constrained.regex_dfa import (
    DEFAULT_MAX_STATES,
    DFA,
    RegexError,
    compile_regex,
    states_reaching,
    strip_leading_space,
)

# Version 2: the DFA and its finishable states, with the cache key inside (rows are built lazily).
CACHE_FORMAT_VERSION = 3
# Walk at most this many (state, token) pairs at once; bounds peak memory of the up-front check.
PAIRS_PER_CHUNK = 1 << 22
# Rows kept per index: (V,) int32 next states + (V,) bool mask, e.g. 136 rows of a 49k vocabulary.
DEFAULT_ROW_CACHE_BYTES = 32 << 20


def gpt2_unicode_to_byte() -> dict:
    """Invert GPT-2's byte -> printable character map that byte-level BPE vocabularies are written
    in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    # The other bytes are shifted to code points 256, 257, ... in byte order (so " " is written
    # "Ġ").
    shifted = [byte for byte in range(256) if byte not in printable]
    return {chr(byte): byte for byte in printable} | {
        chr(256 + index): byte for index, byte in enumerate(shifted)
    }


def _backend_tokenizer(tokenizer) -> Tokenizer:
    """The `tokenizers.Tokenizer` behind a HF fast tokenizer or an mlx-lm TokenizerWrapper."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    # TokenizerWrapper forwards unknown attributes to the HF tokenizer it wraps.
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise TypeError(
            f"expected a tokenizers.Tokenizer, a Hugging Face fast tokenizer or an mlx-lm "
            f"TokenizerWrapper, got {type(tokenizer).__name__}"
        )
    return backend


def _decoder_types(tokenizer: Tokenizer) -> set:
    """Names of the decoders in the tokenizer's decoder pipeline, e.g. {"ByteLevel"}."""
    if tokenizer.decoder is None:
        return set()
    config = json.loads(tokenizer.decoder.__getstate__())
    return {config["type"], *(step["type"] for step in config.get("decoders", []))}


def token_byte_strings(tokenizer, vocab_size: int) -> list:
    """The exact bytes of every token id below `vocab_size`; None for special tokens and unused ids.

    Reads the vocabulary, not decoded text, which would mangle tokens holding part of a UTF-8
    character. Byte-level BPE (GPT-2, Llama 3, SmolLM) is mapped back through the GPT-2 byte
    alphabet; SentencePiece-style vocabularies (Llama 2, Mistral) turn "▁" into a space and
    "<0xNN>" byte-fallback tokens into that byte. The space a SentencePiece decoder strips from the
    start of the text is kept here (the bytes the tokens hold); ``load_or_build_index`` accounts for
    it.

    Args:
        tokenizer: A `tokenizers.Tokenizer`, a Hugging Face fast tokenizer or an mlx-lm
            TokenizerWrapper.
        vocab_size: The model's vocabulary size (its logits' width); may exceed the tokenizer's.
    """
    backend = _backend_tokenizer(tokenizer)
    decoders = _decoder_types(backend)
    if "ByteLevel" in decoders:
        unicode_to_byte = gpt2_unicode_to_byte()

        # None for text not written in the byte alphabet: no token the model spells with
        def to_bytes(text):
            return (
                bytes(unicode_to_byte[char] for char in text)
                if set(text) <= unicode_to_byte.keys()
                else None
            )
    elif decoders & {"Metaspace", "Replace", "ByteFallback"}:
        byte_token = re.compile(r"<0x([0-9A-Fa-f]{2})>")

        def to_bytes(text):
            match = byte_token.fullmatch(text)
            return bytes([int(match[1], 16)]) if match else text.replace("▁", " ").encode()
    else:
        raise ValueError(
            f"unsupported tokenizer: expected a byte-level or SentencePiece decoder, got {decoders}"
        )

    spelled = {
        token_id: to_bytes(text)
        for text, token_id in backend.get_vocab(with_added_tokens=False).items()
    }
    # Added tokens are matched as literal text; special ones (EOS, chat markers) never spell regex
    # text.
    spelled |= {
        token_id: None if added.special else added.content.encode()
        for token_id, added in backend.get_added_tokens_decoder().items()
    }
    return [spelled.get(token_id) for token_id in range(vocab_size)]


@dataclass(frozen=True, eq=False)
class TokenTable:
    """The vocabulary as a padded byte matrix, with tokens grouped by first byte for fast walks."""

    lengths: np.ndarray  # (V,) int64, 0 for tokens that spell nothing (special, unused)
    token_bytes: np.ndarray  # (V, max_len) uint8, zero padded
    by_first_byte: np.ndarray  # spellable token ids sorted by their first byte
    first_byte_starts: np.ndarray  # (257,) offsets into by_first_byte

    @classmethod
    def build(cls, token_bytes: list) -> "TokenTable":
        lengths = np.array([len(token) if token else 0 for token in token_bytes], dtype=np.int64)
        flat = np.frombuffer(b"".join(token for token in token_bytes if token), dtype=np.uint8)
        token_of_byte = np.repeat(np.arange(len(token_bytes)), lengths)
        column_of_byte = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        matrix = np.zeros((len(token_bytes), max(int(lengths.max(initial=0)), 1)), dtype=np.uint8)
        matrix[token_of_byte, column_of_byte] = flat
        spellable = np.flatnonzero(lengths > 0)
        order = spellable[np.argsort(matrix[spellable, 0], kind="stable")]
        return cls(lengths, matrix, order, np.searchsorted(matrix[order, 0], np.arange(257)))

    @property
    def vocab_size(self) -> int:
        return len(self.lengths)

    def starting_with(self, first_bytes: np.ndarray) -> np.ndarray:
        """The spellable token ids whose first byte is in `first_bytes`."""
        starts, ends = self.first_byte_starts[first_bytes], self.first_byte_starts[first_bytes + 1]
        return np.concatenate(
            [self.by_first_byte[s:e] for s, e in zip(starts, ends)] or [np.zeros(0, np.int64)]
        )


def walk_tokens(dfa: DFA, table: TokenTable, origins) -> np.ndarray:
    """(len(origins), V) state reached by each token from each origin state; -1 where the DFA
    rejects it."""
    next_states = np.full((len(origins), table.vocab_size), -1, dtype=np.int32)
    for row, origin_state in enumerate(origins):
        # Only tokens whose first byte the state accepts can survive: often a handful, at most V.
        token = table.starting_with(
            np.flatnonzero(dfa.transitions[origin_state, dfa.byte_class] >= 0)
        )
        state = np.full(len(token), origin_state, dtype=np.int32)
        # The tokens advance one byte column at a time. A token leaves when it ends (record where it
        # got to) or the DFA rejects it, so the work is the number of live token prefixes.
        for column in range(table.token_bytes.shape[1]):
            ended = table.lengths[token] == column
            next_states[row, token[ended]] = state[ended]
            token, state = token[~ended], state[~ended]
            state = dfa.transitions[state, dfa.byte_class[table.token_bytes[token, column]]]
            alive = state >= 0
            token, state = token[alive], state[alive]
            if not len(token):
                break
        next_states[row, token] = state  # tokens of the maximum length
    return next_states


def _token_edges(dfa: DFA, table: TokenTable):
    """(sources, targets): the state graph with an edge s -> t when some token leads from s to t."""
    num_states = dfa.num_states
    rows_per_chunk = max(1, PAIRS_PER_CHUNK // max(table.vocab_size, num_states + 1))
    sources, targets = [], []
    for first in range(0, num_states, rows_per_chunk):
        rows = walk_tokens(dfa, table, range(first, min(first + rows_per_chunk, num_states)))
        # Count (row, target + 1) pairs with one bincount; column 0 collects the forbidden tokens.
        keys = (rows + 1) + (num_states + 1) * np.arange(len(rows))[:, None]
        counts = np.bincount(keys.ravel(), minlength=len(rows) * (num_states + 1))
        chunk_sources, chunk_targets = np.nonzero(counts.reshape(len(rows), num_states + 1)[:, 1:])
        sources.append(chunk_sources + first)
        targets.append(chunk_targets)
    return np.concatenate(sources), np.concatenate(targets)


def finishable_states(dfa: DFA, table: TokenTable) -> np.ndarray:
    """(num_states,) bool: the states from which some sequence of tokens reaches an accepting state.
    Every DFA state can reach acceptance (dead states were removed), so when the one-byte tokens
    cover a path to acceptance from every state, every state is finishable: a cheap DFA-level check.
    Otherwise (a vocabulary that lacks bytes the regex needs) walk every token from every state up
    front, in chunks of bounded memory, and find the finishable states on the token graph."""
    class_covered = np.zeros(dfa.transitions.shape[1], dtype=bool)
    # a one-byte token spells it
    class_covered[dfa.byte_class[table.token_bytes[table.lengths == 1, 0]]] = True
    sources, classes = np.nonzero((dfa.transitions >= 0) & class_covered)
    by_single_bytes = states_reaching(sources, dfa.transitions[sources, classes], dfa.accepting)
    return (
        by_single_bytes
        if by_single_bytes.all()
        else states_reaching(*_token_edges(dfa, table), dfa.accepting)
    )


class TokenIndex:
    """For each DFA state, the allowed tokens and the state each leads to, built on first use.
    `row(state)[token]` is -1 when `token` is forbidden in `state`. EOS tokens are allowed exactly
    in accepting states and map to the same state. Tokens that lead to a state from which the
    vocabulary cannot finish a match are forbidden, so following the masks always leaves a way to
    end. Index states are the DFA's states, so `index.dfa.forced_bytes(state)` gives the text the
    regex forces next."""

    def __init__(
        self,
        dfa: DFA,
        table: TokenTable,
        eos_token_ids,
        finishable: np.ndarray,
        row_cache_bytes: int = DEFAULT_ROW_CACHE_BYTES,
    ):
        self.dfa, self.table = dfa, table
        self.start, self.num_states = dfa.start, dfa.num_states  # index states are the DFA's
        self.eos_token_ids = tuple(int(token) for token in eos_token_ids)
        self.finishable = finishable
        self.max_cached_rows = max(8, row_cache_bytes // (5 * table.vocab_size))
        # state -> (next states (V,) int32, mask (V,) mx bool), LRU order
        self._rows = OrderedDict()

    @classmethod
    def build(cls, dfa: DFA, token_bytes, eos_token_ids, **options) -> "TokenIndex":
        """An index of `dfa` over `token_bytes` (from `token_byte_strings`, or a `TokenTable`); a
        RegexError when no sequence of tokens spells a match at all."""
        table = (
            token_bytes if isinstance(token_bytes, TokenTable) else TokenTable.build(token_bytes)
        )
        finishable = finishable_states(dfa, table)
        if not finishable[dfa.start]:
            raise RegexError(
                f"the vocabulary cannot spell the regex from state {dfa.start}: "
                "no sequence of tokens reaches an accepting state"
            )
        return cls(dfa, table, eos_token_ids, finishable, **options)

    @property
    def cached_bytes(self) -> int:
        """Memory held by the cached rows (the index's only per-state memory besides the DFA)."""
        return sum(row.nbytes + mask.nbytes for row, mask in self._rows.values())

    def _row_and_mask(self, state: int) -> tuple:
        cached = self._rows.get(state)
        if cached is not None:
            self._rows.move_to_end(state)
            return cached
        row = walk_tokens(self.dfa, self.table, [state])[0]
        if not self.finishable.all():
            row[(row >= 0) & ~self.finishable[row]] = -1
        row[list(self.eos_token_ids)] = state if self.dfa.accepting[state] else -1
        cached = self._rows[state] = (row, mx.array(row >= 0))
        if len(self._rows) > self.max_cached_rows:
            self._rows.popitem(last=False)
        return cached

    def row(self, state: int) -> np.ndarray:
        """(V,) int32: the state after each token from `state`, -1 where the token is forbidden."""
        return self._row_and_mask(state)[0]

    def allowed_mask(self, state: int) -> mx.array:
        """(V,) bool: the tokens allowed in `state`, for `mx.where(mask, logits, -mx.inf)`."""
        return self._row_and_mask(state)[1]

    def masks(self, states: list) -> mx.array:
        """(len(states), V) bool: one mask per state, e.g. for each position of a draft."""
        return mx.stack([self.allowed_mask(state) for state in states])

    def next_state(self, state: int, token: int) -> int:
        """The state after `token`, or -1 if `token` is not allowed in `state`."""
        return int(self.row(state)[token])

    def is_accepting(self, state: int) -> bool:
        return bool(self.dfa.accepting[state])


def _cache_key(
    pattern: str, token_bytes: list, eos_token_ids, max_states: int, stripped: bool = False
) -> str:
    # repr writes each token unambiguously (b'...' or None), so different vocabularies never hash
    # the same.
    vocab_hash = hashlib.sha256(repr(token_bytes).encode()).hexdigest()
    eos = sorted(int(t) for t in eos_token_ids)
    return json.dumps([CACHE_FORMAT_VERSION, pattern, vocab_hash, eos, max_states, stripped])


def strips_leading_space(tokenizer, token_bytes: list) -> bool:
    """Whether ``decode`` drops the leading space of the text (SentencePiece decoders with a
    ``Strip`` step, as Llama 2's): asked of the tokenizer itself, with a token that spells a space
    and a word."""
    spaced = next(
        (
            i
            for i, raw in enumerate(token_bytes)
            if raw and len(raw) > 1 and raw[:1] == b" " and raw[1:2].isalnum()
        ),
        None,
    )
    return spaced is not None and tokenizer.decode([spaced]) == token_bytes[spaced][1:].decode(
        "utf-8", "replace"
    )


def save_index(index: TokenIndex, path, key: str) -> None:
    """Write the DFA, its finishable states and `key` to `path` (.npz); atomic for concurrent
    readers."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(partial, "wb") as file:
            # Compressed: transitions are mostly -1, so even 50k states stay a few MB.
            np.savez_compressed(
                file,
                key=np.array(key),
                byte_class=index.dfa.byte_class,
                transitions=index.dfa.transitions,
                accepting=index.dfa.accepting,
                start=index.dfa.start,
                finishable=index.finishable,
            )
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def load_index(path, key: str, table: TokenTable, eos_token_ids):
    """The index saved at `path` under `key`; None if the file is missing, unreadable or for another
    key."""
    try:
        with np.load(path) as arrays:
            if str(arrays["key"]) != key:
                return None
            dfa = DFA(
                arrays["byte_class"],
                arrays["transitions"],
                arrays["accepting"],
                int(arrays["start"]),
            )
            finishable = arrays["finishable"]
    except Exception:  # noqa: BLE001 - any unreadable file (truncated zip, bad arrays, no key) is rebuilt
        return None
    num_states, num_classes = dfa.transitions.shape
    consistent = (
        dfa.byte_class.shape == (256,)
        and dfa.accepting.shape == finishable.shape == (num_states,)
        and 0 <= dfa.start < num_states
        and int(dfa.byte_class.max()) < num_classes
        and int(dfa.transitions.max(initial=-1)) < num_states
    )
    return TokenIndex(dfa, table, eos_token_ids, finishable.astype(bool)) if consistent else None


def load_or_build_index(
    pattern: str,
    tokenizer,
    vocab_size: int,
    eos_token_ids,
    cache_dir=None,
    max_states: int = DEFAULT_MAX_STATES,
) -> TokenIndex:
    """The `TokenIndex` for `pattern`, its DFA loaded from the disk cache or compiled and saved
    there.

    The regex holds for the text ``decode`` shows: where the decoder drops a leading space (Llama
    2's SentencePiece), the DFA reads the first space as nothing (``strip_leading_space``).

    The file holds its own key (pattern, vocabulary hash, EOS ids, format version); a file that is
    unreadable or holds another key is rebuilt. An unwritable cache only costs a warning line. The
    file is small (the DFA, at most `max_states` x byte classes int32), as rows are built lazily.

    Args:
        pattern, tokenizer, vocab_size: The regex (`compile_regex`), and what `token_byte_strings`
            reads.
        eos_token_ids: Tokens that end generation; allowed exactly when the text so far matches.
        cache_dir: Where to keep indexes (main.py: `~/.cache/mlx-decoding/regex-index`); None: in
            memory only.
        max_states: Passed to `compile_regex`: larger regexes are refused with a RegexError.
    """
    token_bytes = token_byte_strings(tokenizer, vocab_size)
    table = TokenTable.build(token_bytes)
    # the regex holds for the text decode shows
    stripped = strips_leading_space(tokenizer, token_bytes)

    def dfa():
        compiled = compile_regex(pattern, max_states)
        return strip_leading_space(compiled) if stripped else compiled

    if cache_dir is None:
        return TokenIndex.build(dfa(), table, eos_token_ids)
    key = _cache_key(pattern, token_bytes, eos_token_ids, max_states, stripped)
    path = Path(cache_dir) / f"{hashlib.sha256(key.encode()).hexdigest()}.npz"
    index = load_index(path, key, table, eos_token_ids)
    if index is None:
        index = TokenIndex.build(dfa(), table, eos_token_ids)
        try:
            save_index(index, path, key)
        except OSError as error:
            sys.stderr.write(
                f"warning: cannot write the regex index cache ({error.strerror}: {path.parent}); "
                "using the index in memory\n"
            )
    return index
