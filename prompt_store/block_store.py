"""Named arrays and string metadata on disk under hex keys, one safetensors file a block, written
by a background thread and capped in size, least recently used out. It knows nothing of models or
caches: ``chain_keys`` names a prompt's blocks so that equal prefixes get equal keys.

    keys = chain_keys(model_identity, prompt_tokens, block_tokens=256)
    with BlockStore("~/.cache/prompts", max_bytes=2**30) as store:
        store.put(keys[0], {"keys": k, "values": v}, {"layer": "0"})  # written off this thread
        found = store.get(keys[0])                                     # (arrays, metadata) or None

Files live at ``DIR/blocks/<key[:2]>/<key>.safetensors``. A file's mtime is its last use, so
several processes sharing one directory evict in one least-recently-used order.
"""

import contextlib
import fcntl
import hashlib
import logging
import os
import queue
import re
import struct
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx

log = logging.getLogger("prompt_store")

FORMAT = "1"
RESERVED = ("format", "checksum")  # metadata keys the store writes itself
STALE_TEMPORARY_SECONDS = 600  # a .tmp- file this old belongs to a writer that crashed
# What ``stats`` counts; stale_temporaries: crashed writers' .tmp- files removed at open.
COUNTS = "hits misses written dropped failed evicted corrupt stale_temporaries".split()
_KEY = re.compile(r"[0-9a-f]{8,128}")


def chain_keys(identity: str, tokens: Sequence[int], block_tokens: int) -> list:
    """Hex sha256 keys of the whole blocks of ``tokens`` (``len(tokens) // block_tokens`` of them):
    key k is sha256(digest k-1 + block k's ids as little-endian int32), digest -1 is
    sha256(identity). A block's key names its whole prefix, so a hit on block k implies 0..k-1."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be at least 1, got {block_tokens}.")
    digest, keys = hashlib.sha256(identity.encode()).digest(), []
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        block = struct.pack(f"<{block_tokens}i", *tokens[start : start + block_tokens])
        digest = hashlib.sha256(digest + block).digest()
        keys.append(digest.hex())
    return keys


def checksum(arrays: dict) -> str:
    """sha256 over each array's name, dtype, shape and raw bytes, in sorted-name order. The header
    fields are hashed too: a flipped bit there would otherwise reread the same bytes as another
    dtype or shape. The arrays must be evaluated (``memoryview`` reads their memory)."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        dtype = str(arrays[name].dtype).rpartition(".")[2]  # "bfloat16"
        digest.update(f"{name}:{dtype}:{tuple(arrays[name].shape)};".encode())
        view = memoryview(arrays[name])
        digest.update(view if view.c_contiguous else view.tobytes())  # hashlib needs contiguous
    return digest.hexdigest()


def _touch(path):
    # Nanoseconds from the clock, not the kernel's coarse file time: blocks used within one tick
    # still get an order.
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def _fsync_folder(folder):
    # Makes a rename or a new entry in ``folder`` survive a power cut.
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class BlockStore:
    """Blocks in ``directory``, at most ``max_bytes`` of them on disk (0: read only, nothing is
    written or evicted), with up to ``queue_blocks`` writes waiting for the writer thread.

    ``get``, ``has``, ``put`` and ``stats`` may be called from one thread while the writer runs;
    ``put`` never waits for the disk. Bad files are misses, never exceptions. Close the store (or
    use it in a ``with`` block) before the process ends: queued writes are lost otherwise."""

    def __init__(self, directory, max_bytes: int = 10 * 2**30, queue_blocks: int = 32):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be 0 (read only) or more, got {max_bytes}.")
        if queue_blocks < 1:
            raise ValueError(f"queue_blocks must be at least 1, got {queue_blocks}.")
        self.directory = Path(directory).expanduser()
        self.blocks, self.lock_path = self.directory / "blocks", self.directory / ".lock"
        try:
            self.blocks.mkdir(parents=True, exist_ok=True)
            self.lock_path.touch()
        except OSError as error:
            raise ValueError(
                f"the prompt store's directory {self.directory} cannot be created: "
                f"{error.strerror}."
            ) from None
        self.max_bytes, self.closed = max_bytes, False
        self._lock = threading.Lock()  # the counters below, shared with the writer thread
        self._counts = dict.fromkeys(COUNTS, 0)
        self._blocks = self._bytes = 0
        self._logged = set()  # kinds of failure already logged
        self._queue = queue.Queue(maxsize=queue_blocks)
        self._waiting = {}  # path -> (arrays, metadata) queued: read from memory until written
        self._remove_stale_temporaries()
        self._enforce_cap()
        self._writer = threading.Thread(target=self._write_loop, name="prompt-store", daemon=True)
        self._writer.start()

    def _path(self, key: str) -> Path:
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"a block key is 8 to 128 lowercase hex digits, got {key!r}.")
        return self.blocks / key[:2] / f"{key}.safetensors"

    def has(self, key: str) -> bool:
        """Whether the block is on disk now or waits to be written (another process may still
        evict it before ``get``)."""
        path = self._path(key)
        return path in self._waiting or path.exists()

    def get(self, key: str) -> Optional[tuple]:
        """``(arrays, metadata)`` as ``put`` got them, or None: missing, evicted meanwhile, or a bad
        file (then removed and counted as ``corrupt``). A hit marks the block as just used."""
        path = self._path(key)
        with self._lock:
            waiting = self._waiting.get(path)
        if waiting is not None:
            self._count("hits")
            return dict(waiting[0]), dict(waiting[1])
        if not path.exists():
            self._count("misses")
            return None
        try:
            arrays, metadata = mx.load(str(path), return_metadata=True)
            mx.eval(arrays)  # reads the file now, so a truncated one fails here
            failure = None
            if metadata.get("format") != FORMAT:
                failure = "format", f"format {metadata.get('format')!r}, not {FORMAT!r}"
            elif metadata.get("checksum") != checksum(arrays):
                failure = "checksum", "its arrays do not match their checksum"
        except Exception as error:  # mlx raises RuntimeError or ValueError for a bad file
            failure = "unreadable", str(error)
        if failure is not None and not path.exists():  # evicted by another process meanwhile
            self._count("misses")
            return None
        if failure is not None:
            self._discard_corrupt(path, *failure)
            return None
        with contextlib.suppress(FileNotFoundError):
            _touch(path)
        self._count("hits")
        return arrays, {name: value for name, value in metadata.items() if name not in RESERVED}

    def _discard_corrupt(self, path: Path, kind: str, why: str):
        size = 0
        with contextlib.suppress(FileNotFoundError):
            size = path.stat().st_size
            path.unlink()
        with self._lock:
            self._counts["corrupt"] += 1
            self._counts["misses"] += 1
            self._blocks, self._bytes = max(self._blocks - 1, 0), max(self._bytes - size, 0)
        self._log_once(f"corrupt {kind}", "prompt store: removed a bad block %s: %s", path, why)

    def put(self, key: str, arrays: dict, metadata: dict) -> bool:
        """Queue the block for the writer thread; False if it was not queued (a full queue, which
        is counted as ``dropped``, or a read-only store). A key already on disk is not rewritten."""
        path = self._path(key)
        if self.closed:
            raise ValueError(f"the prompt store at {self.directory} is closed.")
        if any(not isinstance(value, str) for value in metadata.values()):
            raise ValueError("a block's metadata values must be strings.")
        if any(name in metadata for name in RESERVED):
            raise ValueError(f"a block's metadata may not use the store's own keys {RESERVED}.")
        if self.max_bytes == 0:
            return False
        mx.eval(list(arrays.values()))  # on this thread: the writer only reads memory
        try:
            with self._lock:
                self._queue.put_nowait((path, dict(arrays), dict(metadata)))
                self._waiting[path] = (dict(arrays), dict(metadata))
        except queue.Full:
            self._count("dropped")
            self._log_once(
                "dropped",
                "prompt store: the write queue is full (%d blocks), a block was dropped; "
                "raise queue_blocks to keep more waiting",
                self._queue.maxsize,
            )
            return False
        return True

    def flush(self):
        """Wait until every queued write is on disk and the cap enforced after it."""
        self._queue.join()

    def close(self):
        """Flush and stop the writer thread (again: nothing)."""
        if self.closed:
            return
        self.closed = True
        self._queue.put(None)  # after every queued write
        self._writer.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def stats(self) -> dict:
        """Counts since open; ``blocks`` and ``bytes`` on disk as of the last scan, plus this
        process's writes and removals since."""
        with self._lock:
            counts = dict(self._counts, blocks=self._blocks, bytes=self._bytes)
        return dict(counts, queued=self._queue.qsize())

    def _count(self, name: str, amount: int = 1):
        with self._lock:
            self._counts[name] += amount

    def _log_once(self, kind: str, message: str, *args):
        with self._lock:
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            log.warning(message, *args)

    def _write_loop(self):
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception as error:  # one bad write never ends the thread
                self._count("failed")
                kind = f"failed {type(error).__name__} {getattr(error, 'errno', '')}"
                self._log_once(kind, "prompt store: a block could not be written: %s", error)
            finally:
                if item is not None:
                    with self._lock:
                        self._waiting.pop(item[0], None)
                self._queue.task_done()

    def _write(self, path: Path, arrays: dict, metadata: dict):
        """Write one block atomically: a temporary file in the same folder, fsync'd, renamed onto
        the block's name, so a crash leaves either no block or a whole one."""
        if path.exists():  # written before, here or by another process: mark it as just used
            with contextlib.suppress(FileNotFoundError):  # evicted meanwhile: write it after all
                _touch(path)
                return
        if not path.parent.exists():
            path.parent.mkdir(exist_ok=True)
            _fsync_folder(self.blocks)
        metadata = dict(metadata, format=FORMAT, checksum=checksum(arrays))
        # Unique among live writers: one thread a store writes one block at a time.
        temporary = path.parent / f".tmp-{os.getpid()}-{threading.get_ident()}-{path.name}"
        try:
            with open(temporary, "wb") as file:
                mx.save_safetensors(file, arrays, metadata)
                file.flush()
                os.fsync(file.fileno())
                size = os.fstat(file.fileno()).st_size  # the block may be evicted once renamed
            _touch(temporary)
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise
        _fsync_folder(path.parent)
        with self._lock:
            self._counts["written"] += 1
            self._blocks, self._bytes = self._blocks + 1, self._bytes + size
        self._enforce_cap()

    @contextlib.contextmanager
    def _exclusive(self):
        """The directory's lock, so that two stores never scan and evict at once."""
        with open(self.lock_path, "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)  # released when the file closes
            yield

    def _scan(self) -> list:
        """``(mtime_ns, size, path)`` of every block file, of any model or format."""
        found = []
        for folder in os.scandir(self.blocks):
            if not folder.is_dir():
                continue
            for entry in os.scandir(folder.path):
                if entry.name.startswith(".") or not entry.name.endswith(".safetensors"):
                    continue
                with contextlib.suppress(FileNotFoundError):  # evicted by another process
                    stat = entry.stat()
                    found.append((stat.st_mtime_ns, stat.st_size, entry.path))
        return found

    def _enforce_cap(self):
        """Re-scan the directory (other processes write too) and delete the least recently used
        blocks until the total is within ``max_bytes``."""
        evicted = evicted_bytes = 0
        with self._exclusive():
            blocks = sorted(self._scan())
            total, remaining = sum(size for _, size, _ in blocks), len(blocks)
            for _, size, path in blocks if self.max_bytes else ():  # 0: read only
                if total <= self.max_bytes:
                    break
                total, remaining = total - size, remaining - 1
                try:
                    os.unlink(path)
                except FileNotFoundError:  # evicted by another process
                    continue
                evicted, evicted_bytes = evicted + 1, evicted_bytes + size
                log.debug("prompt store: evicted %s", path)
        with self._lock:
            self._counts["evicted"] += evicted
            self._blocks, self._bytes = remaining, total
        if evicted:
            log.info(
                "prompt store: evicted %d blocks (%.1f MB) to stay under %.3g GB",
                evicted,
                evicted_bytes / 1e6,
                self.max_bytes / 2**30,
            )

    def _remove_stale_temporaries(self):
        """Remove the temporary files of writers that crashed (old enough that none still writes
        them), and say so."""
        removed = removed_bytes = 0
        cutoff = time.time() - STALE_TEMPORARY_SECONDS
        with self._exclusive():
            for folder in os.scandir(self.blocks):
                if not folder.is_dir():
                    continue
                for entry in os.scandir(folder.path):
                    with contextlib.suppress(FileNotFoundError):
                        stat = entry.stat()
                        if entry.name.startswith(".tmp-") and stat.st_mtime < cutoff:
                            os.unlink(entry.path)
                            removed, removed_bytes = removed + 1, removed_bytes + stat.st_size
        self._count("stale_temporaries", removed)
        if removed:
            log.info(
                "prompt store: removed %d temporary files (%.1f MB) left by crashed writers in %s",
                removed,
                removed_bytes / 1e6,
                self.blocks,
            )
