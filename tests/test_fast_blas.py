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

import fast_blas

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="MLX uses Accelerate on macOS")

CHILD = """
import json, sys
import fast_blas
mode = sys.argv[1]
path = None if mode == "none" else fast_blas.load(system=mode == "system", warn=False)
import mlx.core as mx
a = mx.ones((64, 64))
mx.eval(a @ a)  # float32 matmul: MLX calls cblas_sgemm
print(json.dumps({"loaded": path, "mapped": fast_blas.loaded(), "description": fast_blas.describe()}))
"""


def run_child(mode, tmp_path, code=CHILD):
    """Returns the child's JSON report and the library libmlx.so's cblas_sgemm was bound to."""
    env = dict(os.environ, LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(tmp_path / "ld"),
               XDG_CACHE_HOME=str(tmp_path / "cache"))
    env.pop("LD_PRELOAD", None)
    result = subprocess.run([sys.executable, "-c", code, mode], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120, check=True)
    # One log per process: "binding file <user> [0] to <definer> [0]: normal symbol `cblas_sgemm'".
    bound = [line.split(" to ")[1].split(" [")[0]
             for log in tmp_path.glob("ld.*") for line in log.read_text(errors="replace").splitlines()
             if "libmlx.so" in line.split(" to ")[0] and "`cblas_sgemm'" in line]
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


@pytest.mark.parametrize("module", ["speculative.train_head", "benchmarks.run", "convert"])
def test_entry_points_load_it_before_mlx(module, tmp_path):
    # `python -m speculative.train_head` imports the package first: it must not import mlx.core
    # before fast_blas.load() (it did once, and data generation ran ~20x slower).
    if not fast_blas.candidates():
        pytest.skip("no fast BLAS here")
    code = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
import fast_blas
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
import ctypes, json, fast_blas
linked = fast_blas.link_mlx_gfortran(fast_blas.wheel_libraries()[0])
ctypes.CDLL(str(linked), mode=ctypes.RTLD_GLOBAL)
import mlx.core as mx
mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))
maps = open("/proc/self/maps").read().split()
print(json.dumps({"loaded": str(linked), "gfortran": sorted({p for p in maps if "libgfortran" in p})}))
"""
    report, bound = run_child("linked", tmp_path, code)
    assert bound == os.path.realpath(report["loaded"])
    assert report["gfortran"] and all("mlx_cpu.libs" in path for path in report["gfortran"])


def test_one_warning_line_when_nothing_fast_is_found(monkeypatch, capsys):
    monkeypatch.setattr(fast_blas, "loaded", lambda: None)
    monkeypatch.setattr(fast_blas, "candidates", lambda system=True: [])
    assert fast_blas.load() is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install ngsolve-openblas" in err
