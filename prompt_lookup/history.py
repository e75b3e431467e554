"""History lookup: prompt lookup that also copies from the model's own earlier outputs.

A model answers alike from one request to the next, the more so in a workload that sends the same
kind of request over many inputs. SuffixDecoding (Oliaro et al., 2024) drafts from a suffix tree of
past outputs, llama.cpp from an n-gram cache of them; here they are older context for prompt
lookup's vectorized search (``ngram.search``), one pass over a bounded array.

The store on disk is one ``.npz`` file: the outputs' token ids, each followed by ``SEPARATOR``.
"""

import fcntl
import os
import zipfile
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import numpy as np

from prompt_lookup.ngram import SEPARATOR, PromptLookupSource

# Bounds the store, and so the cost of a search (docs/prompt_lookup.md, "Search cost").
DEFAULT_MAX_HISTORY_TOKENS = 32_768


class HistoryError(ValueError):
    """A store file that cannot be read as token ids."""


def join_outputs(outputs: Sequence[Sequence[int]]) -> np.ndarray:
    """Outputs as one store array, ``SEPARATOR`` after each, so no match spans two."""
    parts = [np.append(np.asarray(output, np.int32), SEPARATOR) for output in outputs]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def bound_history(history: np.ndarray, max_tokens: int) -> np.ndarray:
    """The newest outputs that fit in ``max_tokens``; a partly cut oldest output is dropped."""
    if history.size <= max_tokens:
        return history
    kept = history[history.size - max_tokens :]
    # history[-max_tokens - 1] is SEPARATOR exactly when kept starts at an output's start.
    if history[history.size - max_tokens - 1] != SEPARATOR:
        ends = np.flatnonzero(kept == SEPARATOR)
        kept = kept[ends[0] + 1 :] if ends.size else kept[:0]
    return kept


def load_history(path) -> np.ndarray:
    """The store at ``path`` (empty when there is no file yet). A HistoryError says what is wrong
    and leaves advice to the caller: only it knows whether the file is one it made (a cache it
    may tell the user to delete) or one the user named."""
    path = Path(path)
    if not path.exists():
        return np.zeros(0, np.int32)
    if path.is_dir():
        raise HistoryError(f"{path} is a directory, not a history store file")
    try:
        with np.load(path, allow_pickle=False) as data:
            tokens = data["tokens"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        raise HistoryError(f"{path} is not a history store ({error})") from None
    if (
        tokens.ndim != 1
        or not np.issubdtype(tokens.dtype, np.integer)
        or (tokens.size and tokens.min() < SEPARATOR)
    ):
        raise HistoryError(f"{path} is not a history store (it must hold one array of token ids)")
    return tokens.astype(np.int32)


def save_history(path, history: np.ndarray):
    """Write a store array to ``path`` atomically: written aside, then moved into place with
    ``os.replace``, so a reader sees the old store or the new one, never a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as file:
            np.savez_compressed(file, tokens=history)
            file.flush()
            os.fsync(file.fileno())  # the data is on disk before the name points at it
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def append_history(
    path, outputs: Sequence[Sequence[int]], max_tokens: int = DEFAULT_MAX_HISTORY_TOKENS
):
    """Add ``outputs`` (token id lists) to the store at ``path``, keeping at most ``max_tokens``.
    Writers take turns on a lock file, so no run's outputs are lost to another's write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        save_history(
            path,
            bound_history(np.concatenate([load_history(path), join_outputs(outputs)]), max_tokens),
        )


class HistoryLookupSource(PromptLookupSource):
    """``PromptLookupSource`` whose context starts with earlier outputs (older than the prompt).

    The search and the adaptive draft length are prompt lookup's; the store only adds places to copy
    from. ``remember(tokens)`` adds a finished output, so a source reused across ``generate`` calls
    drafts from its own earlier answers too.

    Args:
        history: a store array (``load_history``) or token ids of one output.
        max_history_tokens: drop the oldest outputs beyond this many tokens (it bounds a search's
            cost).
        options: ``PromptLookupSource``'s (``ngram_max``, ``num_draft``, ``extra_context``, ...).
    """

    name = "history_lookup"

    def __init__(
        self,
        history: Sequence[int] = (),
        max_history_tokens: int = DEFAULT_MAX_HISTORY_TOKENS,
        **options,
    ):
        if max_history_tokens < 1:
            raise ValueError(f"max_history_tokens must be at least 1, got {max_history_tokens}.")
        history = np.asarray(history, np.int32)
        if history.size and history.min() < SEPARATOR:
            raise ValueError(
                "history must hold token ids (non-negative integers) and separators (-1)."
            )
        if history.size and history[-1] != SEPARATOR:
            history = np.append(history, SEPARATOR)
        self.max_history_tokens = max_history_tokens
        self.history = bound_history(history, max_history_tokens)
        super().__init__(**options)  # calls reset(), which reads self.history

    def remember(self, tokens: Sequence[int]):
        """Add a finished output to the in-memory store (from the next generation on)."""
        self.history = bound_history(
            np.concatenate([self.history, join_outputs([tokens])]), self.max_history_tokens
        )

    def reset(self, *args, **kwargs):
        super().reset(*args, **kwargs)
        if self.history.size:
            self._context = mx.concatenate([mx.array(self.history, mx.int32), self._context])

    def match_kind(self, ngram: int, start: int):
        """A copy from the store and one from this generation's own context are told apart: a
        3-gram seen in another answer predicts less than one seen in this answer."""
        return super().match_kind(ngram, start), start < self.history.size
