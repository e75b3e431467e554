"""Give MLX's Linux CPU backend a fast BLAS, with no root and no environment variable.

MLX's Linux CPU wheel links a reference BLAS, an order of magnitude slower
than OpenBLAS (benchmarks/results/blas.md). The dynamic linker binds
``cblas_sgemm`` to the first definition in the process's global scope, so a
library loaded with ``RTLD_GLOBAL`` *before* ``import mlx.core`` wins, just as
``LD_PRELOAD`` would. Call ``load()`` first thing in an entry point:

    from loading import fast_blas
    fast_blas.load()
    import mlx.core as mx

On macOS this does nothing (MLX uses Accelerate and Metal there).
"""

import atexit
import ctypes
import hashlib
import importlib.metadata
import mmap
import os
import platform
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

# Distribution packages, most common first: Debian/Ubuntu (libopenblas0-pthread,
# then the alternatives link), Fedora/RHEL (openblas-threads, openblas), Arch.
_ARCH = platform.machine()
SYSTEM_LIBRARIES = (
    f"/usr/lib/{_ARCH}-linux-gnu/openblas-pthread/libopenblas.so.0",
    f"/usr/lib/{_ARCH}-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

# Substrings that identify a fast BLAS in /proc/self/maps (loaded by us or by LD_PRELOAD).
FAST_BLAS_NAMES = ("openblas", "libmkl_rt", "libblis")

INSTALL_HINT = (
    "no fast BLAS found, so matmuls run ~20x slower: pip install ngsolve-openblas "
    "(or sudo apt-get install libopenblas0-pthread)"
)
SLOWER = "MLX keeps its reference BLAS (matmuls ~20x slower)"
_warned = False  # one warning line per process, however often load() is called


def _distribution_files(name: str, folder: str) -> List[Path]:
    """Installed files of a pip distribution under `folder`, from its own record (RECORD).

    The record, not `import` or `find_spec`: a stray folder of the same name earlier on sys.path
    (an empty `mlx/` in the working directory) would otherwise be taken for the package.
    """
    try:
        files = importlib.metadata.distribution(name).files or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return sorted(Path(file.locate()) for file in files if file.parts[0] == folder)


def wheel_libraries() -> List[Path]:
    """BLAS libraries from pip wheels that export unprefixed ``cblas_*`` symbols.

    ``ngsolve-openblas`` (13 MB, OpenBLAS with runtime CPU detection) is in
    requirements.txt; pip's ``mkl`` (about 1 GB) is used when it is installed.
    ``scipy-openblas32/64`` are not usable: their symbols are prefixed.
    """
    found = [
        path
        for path in _distribution_files("ngsolve-openblas", "ngsolve_openblas")
        if path.name.startswith("libopenblas") and ".so" in path.name
    ]
    mkl = Path(sys.prefix) / "lib" / "libmkl_rt.so.2"
    if mkl.exists():
        found.append(mkl)
    return found


def mlx_bundled_libraries() -> List[Path]:
    """The libraries MLX's CPU wheel bundles (``mlx_cpu.libs``: its BLAS, LAPACK, libgfortran)."""
    core = sys.modules.get("mlx.core")
    if core is not None and getattr(core, "__file__", None):  # imported: exactly the one in use
        return sorted((Path(core.__file__).parent.parent / "mlx_cpu.libs").glob("*.so*"))
    return _distribution_files("mlx-cpu", "mlx_cpu.libs")


def _cache_dir() -> Path:
    # loading.cache_dir's root; not imported from there: this file stays free of project imports.
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx-decoding"


def link_mlx_gfortran(library: Path) -> Optional[Path]:
    """A copy of ``library``'s name that finds ``libgfortran.so.5`` without the system package.

    The ngsolve-openblas wheel needs libgfortran.so.5, which a fresh Debian lacks, and looks for
    it first in its own directory (RPATH ``$ORIGIN``). MLX's CPU wheel bundles a libgfortran
    (renamed by auditwheel), so a directory of symlinks, the library beside
    ``libgfortran.so.5`` -> MLX's copy (and that copy's libquadmath), satisfies it. The directory
    is kept in the cache; where that is not writable, in a temporary directory removed at exit.
    None when MLX bundles no libgfortran; OSError when neither directory can be written.
    """
    bundled = mlx_bundled_libraries()
    gfortran = [path for path in bundled if path.name.startswith("libgfortran-")]
    if not gfortran:
        return None
    links = {
        path.name: path
        for path in bundled
        if path.name.startswith(("libgfortran-", "libquadmath-"))
    }
    links.update({"libgfortran.so.5": gfortran[0], library.name: library})
    # Keyed by both files, so a new MLX or wheel gets a new directory, never a stale link.
    key = hashlib.sha256(f"{library.resolve()}:{gfortran[0].resolve()}".encode()).hexdigest()[:16]
    try:
        return _symlink_directory(_cache_dir() / "blas" / key, links) / library.name
    except OSError:  # a read-only or unwritable cache: the links are needed only until dlopen
        temporary = Path(tempfile.mkdtemp(prefix="mlx-decoding-blas-"))
        atexit.register(shutil.rmtree, temporary, ignore_errors=True)
        return _symlink_directory(temporary / key, links) / library.name


def _symlink_directory(final: Path, links: dict) -> Path:
    if final.exists():
        return final
    # Built aside and renamed into place, so concurrent first runs never see half a directory.
    staging = final.with_name(f"{final.name}.tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)  # left by a crashed run with the same pid
    staging.mkdir(parents=True)
    for name, target in links.items():
        (staging / name).symlink_to(target.resolve())
    try:
        staging.rename(final)
    except OSError:  # another process got there first
        shutil.rmtree(staging, ignore_errors=True)
    return final


def candidates(system: bool = True) -> List[Path]:
    """Where to look, in order; ``system=False`` skips the distribution's libraries (tests)."""
    paths = [Path(p) for p in SYSTEM_LIBRARIES] if system else []
    return [p for p in paths if p.exists()] + wheel_libraries()


def _mappings() -> list:
    """(start, end, file offset, path) of each file mapped into this process."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    rows = []
    for fields in map(str.split, lines):
        if len(fields) == 6:  # anonymous mappings have no path
            start, end = (int(address, 16) for address in fields[0].split("-"))
            rows.append((start, end, int(fields[2], 16), fields[5]))
    return rows


def loaded() -> Optional[str]:
    """Path of the fast BLAS mapped into this process (by ``load`` or ``LD_PRELOAD``), or None."""
    for path in dict.fromkeys(row[3] for row in _mappings()):
        # numpy's and scipy's OpenBLAS are mapped too, but their symbols are prefixed.
        if any(name in Path(path).name for name in FAST_BLAS_NAMES) and _exports_cblas(path):
            return path
    return None


def _exports_cblas(path: str) -> bool:
    try:
        return hasattr(ctypes.CDLL(path), "cblas_sgemm")
    except OSError:
        return False


def _load_global(path: Path) -> str:
    """dlopen ``path`` into the global scope (retrying beside MLX's libgfortran); OSError says why
    not."""
    try:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        return str(path)
    except OSError as error:
        if "libgfortran" not in str(error):
            raise
    linked = link_mlx_gfortran(path)
    if linked is None:
        raise OSError(
            f"{path} needs libgfortran.so.5, which neither the system nor MLX's wheel has"
        )
    ctypes.CDLL(str(linked), mode=ctypes.RTLD_GLOBAL)
    return str(path.resolve())


def _warn(message: str):
    global _warned
    if not _warned:
        _warned = True
        sys.stderr.write(f"warning: {message}\n")


def load(system: bool = True, warn: bool = True) -> Optional[str]:
    """Load the first fast BLAS that works; returns its path (None on macOS or when none is found).

    Args:
        system: try the distribution's OpenBLAS before pip wheels (tests pass False).
        warn: print one line on stderr (once per process) saying what failed.
    """
    if sys.platform != "linux":
        return None
    already = loaded()
    if already is not None:
        return already
    if "mlx.core" in sys.modules:  # MLX bound its BLAS calls at import (RTLD_NOW): too late
        if warn:
            _warn(f"fast_blas.load() ran after mlx.core was imported, so {SLOWER}: call it first")
        return None
    failures = []
    for path in candidates(system):
        try:
            return _load_global(path)
        except OSError as error:
            failures.append(f"cannot load {path} ({error.strerror or error})")
    if warn:
        _warn(f"{failures[-1]}, so {SLOWER}" if failures else INSTALL_HINT)
    return None


# Variables that fix a BLAS's thread count when the library loads; a user who sets one keeps it.
THREAD_VARIABLES = (
    "OPENBLAS_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OMP_NUM_THREADS",
)
# Each library's run-time (setter, getter): they change the count after loading, when the
# variables above no longer act.
THREAD_FUNCTIONS = {
    "openblas": ("openblas_set_num_threads", "openblas_get_num_threads"),
    "mkl": ("MKL_Set_Num_Threads", "MKL_Get_Max_Threads"),
}


def _thread_functions():
    """The loaded fast BLAS's (setter, getter) as ctypes functions, or None."""
    path = loaded()
    if path is None:
        return None
    kind = next((kind for kind in THREAD_FUNCTIONS if kind in Path(path).name), None)
    library = ctypes.CDLL(path)  # already mapped: the same library, not a second copy
    names = THREAD_FUNCTIONS.get(kind, ())
    if not names or not all(hasattr(library, name) for name in names):
        return None
    return tuple(getattr(library, name) for name in names)


def set_num_threads(count: int) -> bool:
    """Run the loaded fast BLAS's later calls on ``count`` threads; False when there is none."""
    functions = _thread_functions()
    if functions is None:
        return False
    functions[0](ctypes.c_int(count))
    return True


def num_threads() -> Optional[int]:
    """Threads the loaded fast BLAS uses per call (None without one)."""
    functions = _thread_functions()
    return None if functions is None else functions[1]()


def bound_library(library: str = "libmlx.so", symbol: str = "cblas_sgemm") -> Optional[str]:
    """The mapped file that `library`'s call to `symbol` jumps to, read from its GOT entry.

    MLX is imported with RTLD_NOW, so once `library` is mapped its global offset table holds the
    address the dynamic linker chose: the truth about which BLAS its matmuls run, whatever else
    was loaded later. None when `library` is not mapped or the symbol is not found. ELF64 only.
    """
    rows = _mappings()
    path = next((row[3] for row in rows if Path(row[3]).name == library), None)
    if path is None:
        return None
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _got_target(data, path, rows, symbol)


def _got_target(data, path: str, rows: list, symbol: str) -> Optional[str]:
    """Find `symbol`'s relocation in the ELF file `data` and read the address its GOT slot holds."""
    if data[:6] != b"\x7fELF\x02\x01":  # 64-bit little-endian (x86-64, aarch64) only
        return None
    (section_offset,) = struct.unpack_from("<Q", data, 0x28)
    entry_size, count = struct.unpack_from("<HH", data, 0x3A)
    (header_offset,) = struct.unpack_from("<Q", data, 0x20)
    header_size, header_count = struct.unpack_from("<HH", data, 0x36)
    # Section header: name, type, flags, addr, offset, size, link, info, addralign, entsize.
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, section_offset + i * entry_size)
        for i in range(count)
    ]
    # Load bias: where the file's offset 0 is mapped, less its first PT_LOAD's (page-aligned)
    # address.
    headers = [
        struct.unpack_from("<IIQQ", data, header_offset + i * header_size)
        for i in range(header_count)
    ]
    first_load = min(vaddr for kind, _, _, vaddr in headers if kind == 1) & ~0xFFF
    bias = (
        min(start for start, _, offset, mapped in rows if mapped == path and offset == 0)
        - first_load
    )
    for _, kind, _, _, file_offset, size, link, *_ in sections:
        if kind != 4:  # SHT_RELA: .rela.plt and .rela.dyn
            continue
        symbols, strings = sections[link][4], sections[sections[link][6]][4]
        for index in range(size // 24):
            got_offset, info, _ = struct.unpack_from("<QQq", data, file_offset + 24 * index)
            (name,) = struct.unpack_from("<I", data, symbols + 24 * (info >> 32))
            if data[strings + name : data.find(b"\0", strings + name)] == symbol.encode():
                target = ctypes.c_uint64.from_address(bias + got_offset).value
                return next(
                    (mapped for start, end, _, mapped in rows if start <= target < end), None
                )
    return None


def describe() -> str:
    """The BLAS MLX's CPU matmuls use, in words (before ``import mlx.core``: the one they will
    use)."""
    if sys.platform == "darwin":
        return "Accelerate"
    try:
        path = bound_library() if "mlx.core" in sys.modules else loaded()
    except (OSError, struct.error, ValueError):  # not the ELF64 layout read above
        path = loaded()
    if path is None or not any(name in Path(path).name for name in FAST_BLAS_NAMES):
        return "reference BLAS"
    name = Path(path).name
    kind = "MKL" if "mkl" in name else "BLIS" if "blis" in name else "OpenBLAS"
    return f"{kind} ({path})"
