"""Per-state token masks for regex-constrained decoding.

For every DFA state, `TokenIndex` stores which tokens may come next and the state each one leads to,
so a decoding step is one row lookup: `mx.where(index.allowed_mask(state), logits, -mx.inf)`.
Tokens are handled as raw bytes, so a token that ends halfway through a UTF-8 character is allowed
exactly when the regex allows that character.
"""

import hashlib
import json
import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer

from constrained.regex_dfa import DEFAULT_MAX_STATES, DFA, RegexError, compile_regex, states_reaching
from loading import cache_dir

CACHE_FORMAT_VERSION = 1
# Walk at most this many (state, token) pairs at once; bounds peak memory of `TokenIndex.build`.
PAIRS_PER_CHUNK = 1 << 22


def gpt2_unicode_to_byte() -> dict:
    """Invert GPT-2's byte -> printable character map that byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    # The other bytes are shifted to code points 256, 257, ... in byte order (so " " is written "Ġ").
    shifted = [byte for byte in range(256) if byte not in printable]
    mapping = {chr(byte): byte for byte in printable}
    mapping.update({chr(256 + offset): byte for offset, byte in enumerate(shifted)})
    return mapping


def _backend_tokenizer(tokenizer) -> Tokenizer:
    """The `tokenizers.Tokenizer` behind a HF fast tokenizer or an mlx-lm TokenizerWrapper."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    # TokenizerWrapper forwards unknown attributes to the HF tokenizer it wraps.
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise TypeError(f"expected a tokenizers.Tokenizer, a Hugging Face fast tokenizer or an mlx-lm "
                        f"TokenizerWrapper, got {type(tokenizer).__name__}")
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
    start of the text is kept: the regex sees exactly the bytes the tokens hold.

    Args:
        tokenizer: A `tokenizers.Tokenizer`, a Hugging Face fast tokenizer or an mlx-lm TokenizerWrapper.
        vocab_size: The model's vocabulary size (its logits' width); may exceed the tokenizer's.
    """
    backend = _backend_tokenizer(tokenizer)
    decoders = _decoder_types(backend)
    if "ByteLevel" in decoders:
        unicode_to_byte = gpt2_unicode_to_byte()

        def to_bytes(text):
            return bytes(unicode_to_byte[char] for char in text)
    elif decoders & {"Metaspace", "Replace", "ByteFallback"}:
        byte_token = re.compile(r"<0x([0-9A-Fa-f]{2})>")

        def to_bytes(text):
            match = byte_token.fullmatch(text)
            return bytes([int(match[1], 16)]) if match else text.replace("▁", " ").encode()
    else:
        raise ValueError(f"unsupported tokenizer: expected a byte-level or SentencePiece decoder, got {decoders}")

    token_bytes = [None] * vocab_size
    for text, token_id in backend.get_vocab(with_added_tokens=False).items():
        if token_id < vocab_size:
            try:
                token_bytes[token_id] = to_bytes(text)
            except KeyError:  # not written in the byte alphabet: not a token the model can spell with
                pass
    # Added tokens are matched as literal text; special ones (EOS, chat markers) never spell regex text.
    for token_id, added in backend.get_added_tokens_decoder().items():
        if token_id < vocab_size:
            token_bytes[token_id] = None if added.special else added.content.encode()
    return token_bytes


def _padded_token_classes(token_bytes: list, byte_class: np.ndarray):
    """(V,) token lengths and a (V, max_len) matrix of their byte classes, built without a token loop."""
    lengths = np.array([len(token) if token else 0 for token in token_bytes], dtype=np.int64)
    flat = np.frombuffer(b"".join(token for token in token_bytes if token), dtype=np.uint8)
    token_of_byte = np.repeat(np.arange(len(token_bytes)), lengths)
    column_of_byte = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    classes = np.zeros((len(token_bytes), max(int(lengths.max(initial=0)), 1)), dtype=np.int32)
    classes[token_of_byte, column_of_byte] = byte_class[flat]
    return lengths, classes


def _walk_tokens(dfa: DFA, token_bytes: list) -> np.ndarray:
    """(num_states, V) state reached by each token from each state; -1 where the DFA rejects it."""
    lengths, classes = _padded_token_classes(token_bytes, dfa.byte_class)
    vocab_size = len(token_bytes)
    spellable = np.flatnonzero(lengths > 0).astype(np.int32)
    next_states = np.full((dfa.num_states, vocab_size), -1, dtype=np.int32)
    states_per_chunk = max(1, PAIRS_PER_CHUNK // max(len(spellable), 1))
    for first in range(0, dfa.num_states, states_per_chunk):
        origins = np.arange(first, min(first + states_per_chunk, dfa.num_states), dtype=np.int32)
        # All (origin state, token) pairs advance one byte column at a time. A pair leaves when its
        # token ends (record where it got to) or the DFA rejects it, so the work is about the number
        # of live (state, token prefix) pairs, not V * max_len.
        origin = np.repeat(origins, len(spellable))
        token = np.tile(spellable, len(origins))
        state = origin.copy()
        for column in range(classes.shape[1]):
            ended = lengths[token] == column
            next_states[origin[ended], token[ended]] = state[ended]
            origin, token, state = origin[~ended], token[~ended], state[~ended]
            state = dfa.transitions[state, classes[token, column]]
            alive = state >= 0
            origin, token, state = origin[alive], token[alive], state[alive]
        next_states[origin, token] = state  # tokens of the maximum length
    return next_states


def _token_edges(next_states: np.ndarray):
    """(sources, targets): the state graph with an edge s -> t when some token leads from s to t."""
    num_states, vocab_size = next_states.shape
    rows_per_chunk = max(1, PAIRS_PER_CHUNK // max(vocab_size, num_states + 1))
    sources, targets = [], []
    for first in range(0, num_states, rows_per_chunk):
        rows = next_states[first:first + rows_per_chunk]
        # Count (row, target + 1) pairs with one bincount; column 0 collects the forbidden tokens.
        keys = (rows + 1) + (num_states + 1) * np.arange(len(rows))[:, None]
        counts = np.bincount(keys.ravel(), minlength=len(rows) * (num_states + 1))
        chunk_sources, chunk_targets = np.nonzero(counts.reshape(len(rows), num_states + 1)[:, 1:])
        sources.append(chunk_sources + first)
        targets.append(chunk_targets)
    return np.concatenate(sources), np.concatenate(targets)


@dataclass(eq=False)
class TokenIndex:
    """For each DFA state, the allowed tokens and the state each leads to.

    `next_states[state, token]` is -1 when `token` is forbidden in `state`. EOS tokens are allowed
    exactly in accepting states and map to the same state. Index states are the DFA's states, so
    `index.dfa.forced_bytes(state)` gives the text the regex forces next.
    """

    dfa: DFA
    next_states: np.ndarray  # (num_states, V) int32
    eos_token_ids: tuple

    @classmethod
    def build(cls, dfa: DFA, token_bytes: list, eos_token_ids) -> "TokenIndex":
        """Index every token (bytes from `token_byte_strings`) against every state of `dfa`.

        Tokens that could only lead to a state from which the vocabulary cannot finish a match are
        forbidden too, so following the masks always leaves a way to end. Raises RegexError when no
        sequence of tokens spells a match at all.
        """
        next_states = _walk_tokens(dfa, token_bytes)
        eos_token_ids = tuple(int(token) for token in eos_token_ids)
        for token in eos_token_ids:
            next_states[:, token] = np.where(dfa.accepting, np.arange(dfa.num_states), -1)
        can_finish = states_reaching(*_token_edges(next_states), dfa.accepting)
        if not can_finish[dfa.start]:
            raise RegexError(f"the vocabulary cannot spell the regex from state {dfa.start}: "
                             "no sequence of tokens reaches an accepting state")
        next_states[(next_states >= 0) & ~can_finish[next_states]] = -1
        return cls(dfa, next_states, eos_token_ids)

    @property
    def start(self) -> int:
        return self.dfa.start

    @property
    def num_states(self) -> int:
        return self.dfa.num_states

    @cached_property
    def _allowed(self) -> mx.array:
        # One (num_states, V) bool array, so a mask is a row gather on the device.
        return mx.array(self.next_states >= 0)

    def allowed_mask(self, state: int) -> mx.array:
        """(V,) bool: the tokens allowed in `state`, for `mx.where(mask, logits, -mx.inf)`."""
        return self._allowed[state]

    def masks(self, states: list) -> mx.array:
        """(len(states), V) bool: one mask per state, e.g. for each position of a draft."""
        return self._allowed[mx.array(states)]

    def next_state(self, state: int, token: int) -> int:
        """The state after `token`, or -1 if `token` is not allowed in `state`."""
        return int(self.next_states[state, token])

    def is_accepting(self, state: int) -> bool:
        return bool(self.dfa.accepting[state])

    def save(self, path) -> None:
        """Write the arrays to `path` (.npz); atomic, so concurrent readers never see half a file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(partial, "wb") as file:
            np.savez(file, byte_class=self.dfa.byte_class, transitions=self.dfa.transitions,
                     accepting=self.dfa.accepting, start=self.dfa.start, next_states=self.next_states,
                     eos_token_ids=np.array(self.eos_token_ids, dtype=np.int64))
        os.replace(partial, path)

    @classmethod
    def load(cls, path) -> "TokenIndex":
        with np.load(path) as arrays:
            dfa = DFA(arrays["byte_class"], arrays["transitions"], arrays["accepting"], int(arrays["start"]))
            return cls(dfa, arrays["next_states"], tuple(arrays["eos_token_ids"].tolist()))


def default_cache_dir() -> Path:
    return cache_dir() / "regex-index"


def _cache_key(pattern: str, token_bytes: list, eos_token_ids) -> str:
    vocab_hash = hashlib.sha256()
    for token in token_bytes:
        # Length-prefix each token so different vocabularies never hash the same; None is length -1.
        length = -1 if token is None else len(token)
        vocab_hash.update(length.to_bytes(4, "little", signed=True) + (token or b""))
    key = json.dumps([CACHE_FORMAT_VERSION, pattern, vocab_hash.hexdigest(), sorted(int(t) for t in eos_token_ids)])
    return hashlib.sha256(key.encode()).hexdigest()


def load_or_build_index(pattern: str, tokenizer, vocab_size: int, eos_token_ids, cache_dir=None,
                        max_states: int = DEFAULT_MAX_STATES) -> TokenIndex:
    """The `TokenIndex` for `pattern`, loaded from the disk cache or built and saved there.

    Args:
        pattern: The regex (see `compile_regex`).
        tokenizer: Anything `token_byte_strings` accepts.
        vocab_size: The model's vocabulary size.
        eos_token_ids: Tokens that end generation; allowed exactly when the text so far matches.
        cache_dir: Where to keep indexes; default `$XDG_CACHE_HOME/mlx-decoding/regex-index`.
        max_states: Passed to `compile_regex`.
    """
    token_bytes = token_byte_strings(tokenizer, vocab_size)
    path = Path(cache_dir or default_cache_dir()) / f"{_cache_key(pattern, token_bytes, eos_token_ids)}.npz"
    if path.exists():
        return TokenIndex.load(path)
    index = TokenIndex.build(compile_regex(pattern, max_states), token_bytes, eos_token_ids)
    index.save(path)
    return index
