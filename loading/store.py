"""Model directories written once and then read by many processes, safely under faults.

A conversion writes into a staging directory beside its destination, named
``<name>.converting-<pid>``, and renames it into place when complete: a reader
never sees half a model, and when two processes convert at once the first
rename wins and the other process uses that copy. Staging directories are
removed on every exit Python sees (errors, Ctrl-C, SIGTERM, SIGHUP); those of
processes that died harder (SIGKILL, power loss) are swept by the next run.

``checksums.json`` records each file's size, modification time and SHA-256 at
conversion. Loading compares sizes and times (a few ``stat`` calls) and rehashes
only a file whose time changed (hashing costs about as much as loading), so an
unchanged cache costs next to nothing to check.
"""

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

CHECKSUMS = "checksums.json"
CHECKSUMS_VERSION = 1
LEFTOVER = re.compile(r"\.(converting|removing)-(\d+)$")  # group 2: the PID that made it


def cache_dir() -> Path:
    """Where this tool keeps what it makes once and reuses: converted models, regex indexes, the
    history store."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "mlx-decoding"


def warn(message: str):
    sys.stderr.write(f"warning: {message}\n")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but another user's
        return True
    except (OverflowError, ValueError):  # not a PID this system can have
        return False
    return True


def sweep(parent: Path, pattern: re.Pattern = LEFTOVER):
    """Remove the directories in ``parent`` whose names match ``pattern`` (by default
    ``*.converting-<pid>`` and ``*.removing-<pid>``) and whose process no longer runs."""
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return
    for entry in entries:
        match = pattern.search(entry.name)
        if (
            match
            and entry.is_dir()
            and not entry.is_symlink()
            and not _process_alive(int(match[2]))
        ):
            shutil.rmtree(entry, ignore_errors=True)


def make_staging_dir(path: Path) -> Path:
    """Create ``path``'s empty staging directory; raises OSError when ``path``'s parent is not
    writable."""
    path = Path(path)
    staging = path.with_name(f"{path.name}.converting-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)  # our PID's, from a process that died before us
    for ancestor in path.parents:  # mkdir would say "File exists" for a file in the way
        if ancestor.exists():
            if not ancestor.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(ancestor))
            break
    path.parent.mkdir(parents=True, exist_ok=True)
    staging.mkdir()
    return staging


@contextmanager
def removed_on_exit(staging: Path, keep: bool = False):
    """Remove ``staging`` when the block ends (unless it was renamed away, or ``keep`` and the block
    succeeded). SIGTERM and SIGHUP become SystemExit meanwhile, so killing a conversion cleans up
    too."""
    with _exit_on_termination():
        try:
            yield staging
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    if not keep:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def _exit_on_termination():
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set signal handlers
        return

    def exit_now(signum, frame):
        raise SystemExit(128 + signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        # leave `nohup`'s SIG_IGN and callers' handlers alone
        if signal.getsignal(sig) is signal.SIG_DFL:
            previous[sig] = signal.signal(sig, exit_now)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def publish(staging: Path, path: Path) -> bool:
    """Rename the finished ``staging`` to ``path``; False when another process put a copy there
    first."""
    try:
        os.rename(staging, path)
    except OSError as error:
        if error.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise
    return True


def discard(path: Path):
    """Remove a damaged directory: rename it out of the way first, so no reader sees it half
    deleted."""
    doomed = path.with_name(f"{path.name}.removing-{os.getpid()}")
    try:
        os.rename(path, doomed)
    except FileNotFoundError:  # another process removed it already
        return
    if doomed.is_dir():
        shutil.rmtree(doomed, ignore_errors=True)
    else:
        doomed.unlink(missing_ok=True)


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json_atomically(path: Path, data):
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        partial.write_text(json.dumps(data, indent=1))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def write_checksums(directory: Path):
    """Record size, modification time and SHA-256 of every file in ``directory``."""
    directory = Path(directory)
    files = {}
    for file in sorted(directory.iterdir()):
        if file.is_file() and file.name != CHECKSUMS:
            stat = file.stat()
            files[file.name] = {
                "size": stat.st_size,
                "mtime_ns": stat.st_mtime_ns,
                "sha256": _sha256(file),
            }
    _write_json_atomically(directory / CHECKSUMS, {"version": CHECKSUMS_VERSION, "files": files})


def verify_checksums(directory: Path) -> Optional[str]:
    """None when the files recorded in ``checksums.json`` are intact (or none are recorded),
    else a short description of the damage."""
    directory = Path(directory)
    try:
        record = json.loads((directory / CHECKSUMS).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return f"{CHECKSUMS} is unreadable"
    try:
        if record["version"] != CHECKSUMS_VERSION:
            return f"{CHECKSUMS} has an unknown version"
        refreshed = False
        for name, expected in record["files"].items():
            file = directory / name
            try:
                stat = file.stat()
            except OSError:
                return f"{name} is missing"
            if stat.st_size != expected["size"]:
                return f"{name} has {stat.st_size} bytes instead of {expected['size']}"
            if stat.st_mtime_ns != expected["mtime_ns"]:
                # Touched or copied: only the content can tell.
                if _sha256(file) != expected["sha256"]:
                    return f"{name} changed since it was written"
                expected["mtime_ns"], refreshed = stat.st_mtime_ns, True
    except (KeyError, TypeError, AttributeError):
        return f"{CHECKSUMS} is malformed"
    if refreshed:
        try:  # so the next run takes the fast path again
            _write_json_atomically(directory / CHECKSUMS, record)
        except OSError:
            pass
    return None
