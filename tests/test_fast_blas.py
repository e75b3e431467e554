"""fast_blas: MLX's matmuls really call the library it loads.

Each check runs a fresh interpreter with ``LD_DEBUG=bindings``: the dynamic
linker then logs which library each of libmlx.so's symbols was bound to, so
the tests see where ``cblas_sgemm`` resolves, not just what is mapped.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loading import fast_blas

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="MLX uses Accelerate on macOS")

CHILD = """
import json, sys
from loading import fast_blas
mode = sys.argv[1]
path = None if mode == "none" else fast_blas.load(system=mode == "system", warn=False)
import mlx.core as mx
a = mx.ones((64, 64))
mx.eval(a @ a)  # float32 matmul: MLX calls cblas_sgemm
report = {"loaded": path, "mapped": fast_blas.loaded(), "description": fast_blas.describe()}
print(json.dumps(report))
"""


def run_child(mode, tmp_path, code=CHILD, cwd=ROOT, **env):
    """Returns the child's JSON report and the library libmlx.so's cblas_sgemm was bound to."""
    env = {
        **os.environ,
        "LD_DEBUG": "bindings",
        "LD_DEBUG_OUTPUT": str(tmp_path / "ld"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        **env,
    }
    env.pop("LD_PRELOAD", None)
    result = subprocess.run(
        [sys.executable, "-c", code, mode],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert result.stderr == "", result.stderr  # no warning: a fast BLAS was found
    # One log per process: "binding file <user> [0] to <definer> [0]: normal symbol `cblas_sgemm'".
    bound = [
        line.split(" to ")[1].split(" [")[0]
        for log in tmp_path.glob("ld.*")
        for line in log.read_text(errors="replace").splitlines()
        if "libmlx.so" in line.split(" to ")[0] and "`cblas_sgemm'" in line
    ]
    assert len(set(bound)) == 1, bound
    return json.loads(result.stdout.splitlines()[-1]), os.path.realpath(bound[0])


def test_without_loading_mlx_uses_its_reference_blas(tmp_path):
    # The control: the binding check sees MLX's own reference BLAS when nothing is loaded.
    report, bound = run_child("none", tmp_path)
    assert "mlx_cpu.libs/libblas" in bound
    assert report["mapped"] is None and report["description"] == "reference BLAS"


@pytest.mark.parametrize("mode", ["system", "wheel"])
def test_matmul_binds_to_the_loaded_blas(mode, tmp_path):
    if mode == "system" and not any(Path(p).exists() for p in fast_blas.SYSTEM_LIBRARIES):
        pytest.skip("no distribution OpenBLAS here")
    if mode == "wheel" and not fast_blas.wheel_libraries():
        pytest.skip("pip install ngsolve-openblas (requirements.txt)")
    report, bound = run_child(mode, tmp_path)
    assert report["loaded"] is not None
    assert bound == os.path.realpath(report["loaded"]) == os.path.realpath(report["mapped"])
    if mode == "wheel":
        assert "site-packages" in bound and "mlx_cpu.libs" not in bound


@pytest.mark.parametrize("module", ["head_training.train", "benchmarks.run", "convert"])
def test_entry_points_load_it_before_mlx(module, tmp_path):
    # `python -m head_training.train` imports the package first: it must not import mlx.core
    # before fast_blas.load() (it did once, and data generation ran ~20x slower).
    if not fast_blas.candidates():
        pytest.skip("no fast BLAS here")
    code = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
from loading import fast_blas
import mlx.core as mx
mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))
print(json.dumps({"mapped": fast_blas.loaded()}))
"""
    report, bound = run_child(module, tmp_path, code)
    assert "mlx_cpu.libs/libblas" not in bound and bound == os.path.realpath(report["mapped"])


def test_wheel_finds_libgfortran_without_the_system_package(tmp_path):
    # A fresh Debian has no libgfortran.so.5: the symlink directory must supply MLX's copy,
    # which the loader then maps instead of the system one (RPATH $ORIGIN is searched first).
    if not fast_blas.wheel_libraries():
        pytest.skip("pip install ngsolve-openblas (requirements.txt)")
    code = """
import ctypes, json
from loading import fast_blas
linked = fast_blas.link_mlx_gfortran(fast_blas.wheel_libraries()[0])
ctypes.CDLL(str(linked), mode=ctypes.RTLD_GLOBAL)
import mlx.core as mx
mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))
maps = open("/proc/self/maps").read().split()
gfortran = sorted({p for p in maps if "libgfortran" in p})
print(json.dumps({"loaded": str(linked), "gfortran": gfortran}))
"""
    report, bound = run_child("linked", tmp_path, code)
    assert bound == os.path.realpath(report["loaded"])
    assert report["gfortran"] and all("mlx_cpu.libs" in path for path in report["gfortran"])


@pytest.fixture
def nothing_loaded(monkeypatch):
    """load() as in a fresh process: no fast BLAS mapped, mlx.core not imported, no warning yet."""
    monkeypatch.setattr(fast_blas, "loaded", lambda: None)
    monkeypatch.setattr(fast_blas, "_warned", False)
    monkeypatch.delitem(sys.modules, "mlx.core", raising=False)


def test_one_warning_line_when_nothing_fast_is_found(nothing_loaded, monkeypatch, capsys):
    monkeypatch.setattr(fast_blas, "candidates", lambda system=True: [])
    assert fast_blas.load() is None and fast_blas.load() is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install ngsolve-openblas" in err  # once per process


def test_a_library_that_fails_to_load_is_named_not_reinstalled(
    nothing_loaded, monkeypatch, capsys, tmp_path
):
    broken = tmp_path / "libopenblas.so.0"
    broken.write_bytes(b"not an ELF file")
    monkeypatch.setattr(fast_blas, "candidates", lambda system=True: [broken])
    assert fast_blas.load() is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot load {broken}" in err and "pip install" not in err


def test_without_a_fast_blas_at_import_describe_says_reference(tmp_path):
    # Loaded after `import mlx.core`: MLX's calls are already bound (RTLD_NOW) to its own BLAS.
    if not fast_blas.wheel_libraries():
        pytest.skip("pip install ngsolve-openblas (requirements.txt)")
    code = """
import ctypes, json, sys
import mlx.core as mx
from loading import fast_blas
late = fast_blas.load(warn=False)
linked = fast_blas.link_mlx_gfortran(fast_blas.wheel_libraries()[0])
ctypes.CDLL(str(linked), mode=ctypes.RTLD_GLOBAL)  # mapped now, but too late
mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))
print(json.dumps({"late": late, "mapped": fast_blas.loaded(), "description": fast_blas.describe()}))
"""
    report, bound = run_child("late", tmp_path, code)
    assert "mlx_cpu.libs/libblas" in bound
    assert report["late"] is None and report["mapped"] is not None
    assert report["description"] == "reference BLAS"


def test_an_empty_mlx_folder_first_on_the_path_does_not_hide_mlx(tmp_path):
    # `mlx` is a namespace package: an empty mlx/ in the working directory becomes its first
    # portion.
    if not fast_blas.wheel_libraries():
        pytest.skip("pip install ngsolve-openblas (requirements.txt)")
    (tmp_path / "work" / "mlx").mkdir(parents=True)
    report, bound = run_child(
        "wheel", tmp_path, cwd=tmp_path / "work", PYTHONPATH=f"{tmp_path / 'work'}:{ROOT}"
    )
    assert report["loaded"] is not None and "site-packages" in bound and "mlx_cpu.libs" not in bound
    assert report["description"].startswith("OpenBLAS")


def test_an_unwritable_cache_links_in_a_temporary_directory(tmp_path):
    if not fast_blas.wheel_libraries():
        pytest.skip("pip install ngsolve-openblas (requirements.txt)")
    (tmp_path / "a-file").write_text("")
    (tmp_path / "tmp").mkdir()
    report, bound = run_child(
        "wheel",
        tmp_path,
        XDG_CACHE_HOME=str(tmp_path / "a-file" / "cache"),
        TMPDIR=str(tmp_path / "tmp"),
    )
    # The linker names the symlink it opened, which is gone by now: compare names.
    assert report["loaded"] is not None and Path(bound).name == Path(report["mapped"]).name
    assert "mlx_cpu.libs" not in bound and report["description"].startswith("OpenBLAS")
    assert list((tmp_path / "tmp").iterdir()) == []  # removed at exit
