"""The prompt store's blocks on disk: keys, round trips in every dtype, bad files, atomic writes,
the writer thread, the size cap (least recently used out), two stores and two processes on one
directory, the startup scan and the arguments it refuses."""

import errno
import fcntl
import hashlib
import logging
import os
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest

from prompt_store import BlockStore, chain_keys
from prompt_store import block_store as block_store_module
from tests.helpers import running

ROOT = Path(__file__).resolve().parent.parent
KEYS = chain_keys("test-model", list(range(64 * 4)), 4)  # 64 distinct keys


def block(seed: int, dtype=mx.float32) -> dict:
    """Arrays that differ with ``seed``, of equal size for equal dtypes (so files are equal too)."""
    base = mx.arange(4 * 64, dtype=mx.int32).reshape(4, 64) + seed
    return {"keys": base.astype(dtype), "values": (base * 2).astype(dtype)}


def block_path(directory: Path, key: str) -> Path:
    return directory / "blocks" / key[:2] / f"{key}.safetensors"


def same(arrays: dict, expected: dict) -> bool:
    return set(arrays) == set(expected) and all(
        arrays[name].dtype == expected[name].dtype and mx.array_equal(arrays[name], expected[name])
        for name in expected
    )


def warnings(caplog, text: str) -> list:
    return [r for r in caplog.records if r.name == "prompt_store" and text in r.getMessage()]


def test_chain_keys_hash_each_block_after_the_one_before():
    tokens = [5, 70000, 2, 9, 1, 3, 8]
    digest = hashlib.sha256(b"model-a").digest()
    expected = []
    for start in (0, 3):
        digest = hashlib.sha256(digest + struct.pack("<3i", *tokens[start : start + 3])).digest()
        expected.append(digest.hex())
    assert chain_keys("model-a", tokens, 3) == expected  # the partial last block has no key
    assert chain_keys("model-a", tokens[:6] + [4], 3) == expected  # a prefix's keys are shared
    assert chain_keys("model-a", [9, 9, 9] + tokens[3:], 3)[1] != expected[1]  # chained
    assert chain_keys("model-b", tokens, 3)[0] != expected[0]
    assert chain_keys("model-a", tokens[:2], 3) == []
    with pytest.raises(ValueError, match="block_tokens"):
        chain_keys("model-a", tokens, 0)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32, mx.int32, mx.uint32])
def test_a_block_round_trips_in_every_dtype(tmp_path, dtype):
    arrays = dict(block(1, dtype), transposed=block(2, dtype)["keys"].T)  # not contiguous
    with BlockStore(tmp_path) as store:
        assert store.put(KEYS[0], arrays, {"layers": "2"})
        store.flush()
        assert store.has(KEYS[0]) and not store.has(KEYS[1])
        found_arrays, metadata = store.get(KEYS[0])
        assert same(found_arrays, arrays) and metadata == {"layers": "2"}
        assert store.get(KEYS[1]) is None
        assert store.stats()["hits"] == 1 and store.stats()["misses"] == 1
    # On disk: the layout, the format and the checksum, as mlx's own loader reads them.
    on_disk, file_metadata = mx.load(str(block_path(tmp_path, KEYS[0])), return_metadata=True)
    assert same(on_disk, arrays)
    assert file_metadata["format"] == "1" and len(file_metadata["checksum"]) == 64


def test_a_bad_block_is_a_counted_logged_and_removed_miss(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="prompt_store")
    with BlockStore(tmp_path) as store:
        for index in range(6):
            store.put(KEYS[index], block(index), {})
        store.flush()
        paths = [block_path(tmp_path, key) for key in KEYS[:6]]
        data = paths[0].read_bytes()
        paths[0].write_bytes(data[: len(data) // 2])  # truncated
        for path in paths[1:3]:  # one flipped bit in the arrays' bytes, twice
            flipped = bytearray(path.read_bytes())
            flipped[-1] ^= 1
            path.write_bytes(bytes(flipped))
        arrays, metadata = mx.load(str(paths[3]), return_metadata=True)
        mx.save_safetensors(str(paths[3]), arrays, dict(metadata, format="0"))  # another format
        paths[4].write_bytes(b"not a safetensors file")
        for key in KEYS[:5]:
            assert store.get(key) is None
        assert store.get(KEYS[5]) is not None  # the good one still reads
        assert [path.exists() for path in paths] == [False] * 5 + [True]
        assert store.stats()["corrupt"] == 5 and store.stats()["misses"] == 5
        assert store.stats()["blocks"] == 1
    # Once per kind: unreadable (the truncated and the foreign file), checksum, format.
    assert len(warnings(caplog, "bad block")) == 3
    assert len(warnings(caplog, "checksum")) == 1


def fail_file_fsync(monkeypatch, errors: list):
    """``os.fsync`` of a regular file raises the next of ``errors`` (folders still sync)."""
    real_fsync = os.fsync

    def fsync(descriptor):
        if errors and stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise errors.pop(0)
        real_fsync(descriptor)

    monkeypatch.setattr(block_store_module.os, "fsync", fsync)


def test_writes_are_atomic_and_a_failed_one_leaves_nothing(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="prompt_store")
    renames, real_replace = [], os.replace
    monkeypatch.setattr(
        block_store_module.os,
        "replace",
        lambda *paths: renames.append(paths) or real_replace(*paths),
    )
    full = OSError(errno.ENOSPC, "No space left on device")
    denied = PermissionError(errno.EACCES, "Permission denied")
    fail_file_fsync(monkeypatch, [full, OSError(errno.ENOSPC, "again"), denied])
    with BlockStore(tmp_path) as store:
        for index in range(4):
            assert store.put(KEYS[index], block(index), {})
        store.flush()
        assert [store.has(key) for key in KEYS[:4]] == [False, False, False, True]
        assert store.stats()["failed"] == 3 and store.stats()["written"] == 1
    # Nothing half-written under a block's name, no temporary file left behind.
    assert [path.name for path in tmp_path.rglob("*.safetensors")] == [f"{KEYS[3]}.safetensors"]
    assert not list(tmp_path.rglob(".tmp-*"))
    # The one write that landed went through a temporary file in the block's own folder.
    ((temporary, final),) = renames
    assert Path(temporary).parent == Path(final).parent == block_path(tmp_path, KEYS[3]).parent
    assert Path(temporary).name.startswith(f".tmp-{os.getpid()}-")
    # The first of each kind of failure is logged with its message.
    logged = warnings(caplog, "could not be written")
    assert len(logged) == 2 and "No space left" in logged[0].getMessage()


def test_a_full_queue_drops_a_write_and_says_how_to_raise_it(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="prompt_store")
    with BlockStore(tmp_path, queue_blocks=1) as store:
        started, release, real_write = threading.Event(), threading.Event(), store._write

        def slow_write(*item):
            started.set()
            release.wait(10)
            real_write(*item)

        monkeypatch.setattr(store, "_write", slow_write)
        assert store.put(KEYS[0], block(0), {})
        assert started.wait(10)  # the writer holds block 0: the queue has room for one more
        assert store.put(KEYS[1], block(1), {})
        assert not store.put(KEYS[2], block(2), {}) and not store.put(KEYS[3], block(3), {})
        assert store.stats()["queued"] == 1 and store.stats()["dropped"] == 2
        release.set()
        store.flush()
        assert store.stats()["written"] == 2 and store.stats()["queued"] == 0
    (logged,) = warnings(caplog, "dropped")
    assert "queue_blocks" in logged.getMessage()


def test_a_block_already_on_disk_is_not_rewritten_but_marked_used(tmp_path):
    with BlockStore(tmp_path) as store:
        store.put(KEYS[0], block(0), {})
        store.flush()
        path = block_path(tmp_path, KEYS[0])
        os.utime(path, (1, 1))
        lazy = {name: array + 0 for name, array in block(0).items()}  # put evaluates it
        assert store.put(KEYS[0], lazy, {})
        store.flush()
        assert store.stats()["written"] == 1 and path.stat().st_mtime > 1


def test_the_cap_evicts_the_least_recently_used_block(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="prompt_store")
    with BlockStore(tmp_path / "probe") as probe:  # every test block has this size
        probe.put(KEYS[0], block(0), {})
    size = block_path(tmp_path / "probe", KEYS[0]).stat().st_size
    with BlockStore(tmp_path, max_bytes=3 * size + size // 2) as store:
        for index in range(3):
            store.put(KEYS[index], block(index), {})
            store.flush()
        assert store.get(KEYS[0]) is not None  # used: block 1 is now the oldest
        store.put(KEYS[3], block(3), {})
        store.flush()
        assert [store.has(key) for key in KEYS[:4]] == [True, False, True, True]
        stats = store.stats()
        assert stats["evicted"] == 1 and stats["blocks"] == 3 and stats["bytes"] == 3 * size
    assert len(warnings(caplog, "evicted 1 blocks")) == 1
    # Another model's block, of another format, counts and goes the same way, unread.
    foreign = block_path(tmp_path, "ff" * 32)
    foreign.parent.mkdir()
    foreign.write_bytes(b"x" * size)
    os.utime(foreign, (1, 1))
    # Reopened with room for two: the cap holds from the start, the two most recently used (0 by
    # its get, then 3) stay.
    with BlockStore(tmp_path, max_bytes=2 * size) as store:
        assert [store.has(key) for key in KEYS[:4]] == [True, False, False, True]
        assert not foreign.exists() and store.stats()["evicted"] == 2


def test_two_stores_share_a_directory(tmp_path):
    with BlockStore(tmp_path) as first, BlockStore(tmp_path, max_bytes=1) as second:
        first.put(KEYS[0], block(0), {})
        first.flush()
        assert same(second.get(KEYS[0])[0], block(0))
        # Both write one key: both succeed, one whole file is left.
        for store in (first, second):
            assert store.put(KEYS[1], block(1), {})
        first.flush()
        second.flush()
        assert first.stats()["failed"] == second.stats()["failed"] == 0
        # ``second``'s cap of one byte evicted everything after its write: ``first`` sees a miss.
        assert not first.has(KEYS[0]) and first.get(KEYS[0]) is None
        assert first.stats()["corrupt"] == 0 and first.stats()["misses"] == 1


def test_opening_waits_for_the_directory_lock(tmp_path):
    BlockStore(tmp_path).close()
    opened = []
    with open(tmp_path / ".lock", "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # as another process's eviction would
        opener = threading.Thread(target=lambda: opened.append(BlockStore(tmp_path)))
        opener.start()
        time.sleep(0.3)
        assert not opened
    opener.join(10)
    assert opened
    opened[0].close()


WRITER = """
import sys
import mlx.core as mx
from prompt_store import BlockStore
from tests.test_block_store import KEYS, block
with BlockStore(sys.argv[1]) as store:
    for index in range(40):
        store.put(KEYS[index], block(index), {"index": str(index)})
        store.flush()
print("done", flush=True)
"""


def test_a_reader_process_sees_whole_blocks_or_misses(tmp_path):
    command = [sys.executable, "-c", WRITER, str(tmp_path)]
    with BlockStore(tmp_path) as reader:
        reader.put(KEYS[5], block(5), {"index": "5"})  # both processes write this one
        with running(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as writer:
            while writer.poll() is None:
                for index in range(40):
                    found = reader.get(KEYS[index])
                    assert found is None or same(found[0], block(index))
            out, err = writer.communicate(timeout=60)
        assert writer.returncode == 0 and out.strip() == b"done", err.decode()[-2000:]
        for index in range(40):
            arrays, metadata = reader.get(KEYS[index])
            assert same(arrays, block(index)) and metadata == {"index": str(index)}
        assert reader.stats()["corrupt"] == 0 and reader.stats()["failed"] == 0


def test_opening_removes_only_stale_temporary_files(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="prompt_store")
    folder = tmp_path / "blocks" / "ab"
    folder.mkdir(parents=True)
    stale, fresh, other = folder / ".tmp-1-a", folder / ".tmp-2-b", folder / "notes.txt"
    for path in (stale, fresh, other):
        path.write_bytes(b"x" * 1000)
    long_ago = time.time() - 11 * 60
    os.utime(stale, (long_ago, long_ago))
    os.utime(other, (long_ago, long_ago))
    with BlockStore(tmp_path) as store:
        assert store.stats()["stale_temporaries"] == 1
    assert not stale.exists() and fresh.exists() and other.exists()
    assert len(warnings(caplog, "removed 1 temporary files")) == 1


def test_bad_arguments_are_refused_in_one_sentence(tmp_path):
    with pytest.raises(ValueError, match="max_bytes must be 0 .* got -1"):
        BlockStore(tmp_path, max_bytes=-1)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=f"{tmp_path / 'file' / 'store'} cannot be created"):
        BlockStore(tmp_path / "file" / "store")
    with BlockStore(tmp_path / "store") as store:
        with pytest.raises(ValueError, match="hex digits"):
            store.get("../../etc/passwd")
        with pytest.raises(ValueError, match="strings"):
            store.put(KEYS[0], block(0), {"layers": 2})
    with pytest.raises(ValueError, match="closed"):
        store.put(KEYS[0], block(0), {})


def test_a_store_without_room_reads_and_never_writes(tmp_path):
    with BlockStore(tmp_path) as store:
        store.put(KEYS[0], block(0), {})
    with BlockStore(tmp_path, max_bytes=0) as read_only:  # opening evicts nothing either
        assert same(read_only.get(KEYS[0])[0], block(0))
        assert not read_only.put(KEYS[1], block(1), {})
        read_only.flush()
        assert not read_only.has(KEYS[1]) and read_only.stats()["dropped"] == 0


def test_counts_add_up_while_the_writer_runs(tmp_path):
    store = BlockStore(tmp_path, queue_blocks=4)
    puts = gets = 0
    for index in range(30):
        puts += 1
        store.put(KEYS[index], block(index), {})
        for earlier in range(max(index - 3, 0), index):
            gets += 1
            found = store.get(KEYS[earlier])
            assert found is None or same(found[0], block(earlier))
        assert store.stats()["queued"] <= 4
    store.flush()
    stats = store.stats()
    assert stats["written"] + stats["dropped"] == puts and stats["hits"] + stats["misses"] == gets
    on_disk = list(tmp_path.rglob("*.safetensors"))
    assert stats["blocks"] == len(on_disk) == stats["written"]
    assert stats["bytes"] == sum(path.stat().st_size for path in on_disk)
    store.close()
    store.close()  # a second close does nothing
    assert not store._writer.is_alive()
