"""Give MLX's Linux CPU backend a fast BLAS, with no root and no environment variable.

MLX's Linux CPU wheel links a reference BLAS (about 3 GFLOP/s on a 2-core
x86-64 VM, against 50-70 with OpenBLAS). The dynamic linker binds
``cblas_sgemm`` to the first definition in the process's global scope, so a
library loaded with ``RTLD_GLOBAL`` *before* ``import mlx.core`` wins, just as
``LD_PRELOAD`` would. Call ``load()`` first thing in an entry point:

    import fast_blas
    fast_blas.load()
    import mlx.core as mx

On macOS this does nothing (MLX uses Accelerate and Metal there).
"""

import ctypes
import hashlib
import importlib.util
import os
import platform
import shutil
import sys
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

INSTALL_HINT = ("no fast BLAS found, so matmuls run ~20x slower: pip install ngsolve-openblas "
                "(or sudo apt-get install libopenblas0-pthread)")


def wheel_libraries() -> List[Path]:
    """BLAS libraries from pip wheels that export unprefixed ``cblas_*`` symbols.

    ``ngsolve-openblas`` (13 MB, OpenBLAS with runtime CPU detection) is in
    requirements.txt; pip's ``mkl`` (about 1 GB) is used when it is installed.
    ``scipy-openblas32/64`` are not usable: their symbols are prefixed.
    """
    found = []
    # find_spec, not import: ngsolve_openblas's __init__ loads its library itself and prints on failure.
    spec = importlib.util.find_spec("ngsolve_openblas")
    if spec is not None and spec.submodule_search_locations:
        found += sorted(Path(spec.submodule_search_locations[0]).glob("libopenblas*.so*"))
    mkl = Path(sys.prefix) / "lib" / "libmkl_rt.so.2"
    if mkl.exists():
        found.append(mkl)
    return found


def _cache_dir() -> Path:
    # loading.cache_dir's root; not imported from there because loading imports mlx.core.
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx-decoding"


def link_mlx_gfortran(library: Path) -> Optional[Path]:
    """A copy of ``library``'s name that finds ``libgfortran.so.5`` without the system package.

    The ngsolve-openblas wheel needs libgfortran.so.5, which a fresh Debian lacks, and looks for
    it first in its own directory (RPATH ``$ORIGIN``). MLX's CPU wheel bundles a libgfortran
    (renamed by auditwheel), so a directory of symlinks, the library beside
    ``libgfortran.so.5`` -> MLX's copy (and that copy's libquadmath), satisfies it.
    """
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return None
    bundled = Path(spec.submodule_search_locations[0]).parent / "mlx_cpu.libs"
    gfortran = sorted(bundled.glob("libgfortran-*.so.5*"))
    if not gfortran:
        return None
    # Keyed by both files, so a new MLX or wheel gets a new directory, never a stale link.
    key = hashlib.sha256(f"{library.resolve()}:{gfortran[0].resolve()}".encode()).hexdigest()[:16]
    final = _cache_dir() / "blas" / key
    if not final.exists():
        # Built aside and renamed into place, so concurrent first runs never see half a directory.
        staging = final.with_name(f"{key}.tmp{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)  # left by a crashed run with the same pid
        staging.mkdir(parents=True)
        for path in [*gfortran, *bundled.glob("libquadmath-*")]:  # libgfortran needs its libquadmath
            (staging / path.name).symlink_to(path.resolve())
        (staging / "libgfortran.so.5").symlink_to(gfortran[0].resolve())
        (staging / library.name).symlink_to(library.resolve())
        try:
            staging.rename(final)
        except OSError:  # another process got there first
            shutil.rmtree(staging, ignore_errors=True)
    return final / library.name


def candidates(system: bool = True) -> List[Path]:
    """Where to look, in order; ``system=False`` skips the distribution's libraries (tests)."""
    paths = [Path(p) for p in SYSTEM_LIBRARIES] if system else []
    return [p for p in paths if p.exists()] + wheel_libraries()


def loaded() -> Optional[str]:
    """Path of the fast BLAS mapped into this process (by ``load`` or ``LD_PRELOAD``), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    # Each line ends in the mapped file's path; anonymous mappings have none.
    paths = dict.fromkeys(fields[5] for fields in map(str.split, maps.splitlines()) if len(fields) == 6)
    for path in paths:
        # numpy's and scipy's OpenBLAS are mapped too, but their symbols are prefixed.
        if any(name in Path(path).name for name in FAST_BLAS_NAMES) and _exports_cblas(path):
            return path
    return None


def _exports_cblas(path: str) -> bool:
    try:
        return hasattr(ctypes.CDLL(path), "cblas_sgemm")
    except OSError:
        return False


def _load_global(path: Path) -> Optional[str]:
    """dlopen ``path`` into the global scope; when libgfortran is missing, retry beside MLX's."""
    try:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        return str(path)
    except OSError as error:
        if "libgfortran" not in str(error):
            return None
    try:
        linked = link_mlx_gfortran(path)
        if linked is None:
            return None
        ctypes.CDLL(str(linked), mode=ctypes.RTLD_GLOBAL)
        return str(linked)
    except OSError:  # e.g. an unwritable cache directory
        return None


def load(system: bool = True, warn: bool = True) -> Optional[str]:
    """Load the first fast BLAS that works; returns its path (None on macOS or when none is found).

    Args:
        system: try the distribution's OpenBLAS before pip wheels (tests pass False).
        warn: print one line on stderr saying what to install when none is found.
    """
    if sys.platform != "linux":
        return None
    already = loaded()
    if already is not None:
        return already
    for path in candidates(system):
        loaded_path = _load_global(path)
        if loaded_path is not None:
            return loaded_path
    if warn:
        sys.stderr.write(f"warning: {INSTALL_HINT}\n")
    return None


# Variables that fix a BLAS's thread count when the library loads; a user who sets one keeps it.
THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")
# Each library's run-time (setter, getter): they change the count after loading, when the
# variables above no longer act.
THREAD_FUNCTIONS = {"openblas": ("openblas_set_num_threads", "openblas_get_num_threads"),
                    "mkl": ("MKL_Set_Num_Threads", "MKL_Get_Max_Threads")}


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


def describe() -> str:
    """The BLAS MLX's CPU matmuls use, in words."""
    if sys.platform == "darwin":
        return "Accelerate"
    path = loaded()
    if path is None:
        return "reference BLAS"
    name = Path(path).name
    kind = "MKL" if "mkl" in name else "BLIS" if "blis" in name else "OpenBLAS"
    return f"{kind} ({path})"
