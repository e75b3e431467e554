"""Which BLAS makes MLX's Linux CPU backend fast, and is the pip one as fast as the system one?

    python -m benchmarks.blas

A BLAS is chosen once per process, so each one runs in its own interpreter:
a float32 576 x 576 x 1024 matmul (GFLOP/s, best of 20) and ``main.py`` decoding
(tok/s, greedy, 64 new tokens). Rounds interleave the BLASes (A, B, C, A, B, C, ...).
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import fast_blas

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PROMPT = "Explain how a bicycle works, step by step."
CHOICES = {
    "reference": "MLX's bundled reference BLAS (nothing loaded)",
    "system": "Debian's OpenBLAS (libopenblas0-pthread)",
    "wheel": "pip ngsolve-openblas",
    "wheel-mlx-gfortran": "pip ngsolve-openblas with MLX's libgfortran (a machine without libgfortran5)",
}


# Run with `python -c` from the repository root: importing the benchmarks package would load a BLAS first.
CHILD = """
import ctypes, io, json, sys, time
from contextlib import redirect_stdout

import fast_blas

name, prompt = sys.argv[1:]
if name == "system":
    path = fast_blas.load(system=True)
elif name == "wheel":
    path = fast_blas.load(system=False)
elif name == "wheel-mlx-gfortran":
    path = str(fast_blas.link_mlx_gfortran(fast_blas.wheel_libraries()[0]))
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
else:
    path = None
fast_blas.load = lambda **_: path  # keep main.py from loading another one

import mlx.core as mx
import main

a, b = mx.random.normal((576, 1024)), mx.random.normal((1024, 576))
mx.eval(a, b)
best = float("inf")
for _ in range(20):
    tic = time.perf_counter()
    mx.eval(a @ b)
    best = min(best, time.perf_counter() - tic)
sys.argv = ["main.py", "--prompt", prompt, "--max-tokens", "64", "--json"]
with redirect_stdout(io.StringIO()) as out:
    main.main()
result = json.loads(out.getvalue())
print(json.dumps({"gflops": 2 * 576 * 576 * 1024 / best / 1e9, "tps": result["generation_tps"],
                  "blas": fast_blas.describe()}))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="OpenBLAS threads (default: OpenBLAS's own choice, one per core).")
    args = parser.parse_args()

    has_system = any(Path(p).exists() for p in fast_blas.SYSTEM_LIBRARIES)
    names = [n for n in CHOICES if (n != "system" or has_system) and (not n.startswith("wheel")
                                                                         or fast_blas.wheel_libraries())]
    runs = {name: [] for name in names}
    env = dict(os.environ)
    if args.threads is not None:
        env["OPENBLAS_NUM_THREADS"] = str(args.threads)
    for _ in range(args.rounds):
        for name in names:
            out = subprocess.run([sys.executable, "-c", CHILD, name, PROMPT], cwd=ROOT, env=env,
                                 capture_output=True, text=True, check=True)
            runs[name].append(json.loads(out.stdout.splitlines()[-1]))
            print(name, runs[name][-1], flush=True)

    system = statistics.median(r["tps"] for r in runs["system"]) if "system" in runs else None
    rows = ["| BLAS | library | GFLOP/s (576x576x1024) | tok/s | vs Debian OpenBLAS |", "|---|---|---:|---:|---:|"]
    for name, results in runs.items():
        tps = statistics.median(r["tps"] for r in results)
        ratio = f"{tps / system:.2f}x" if system else "-"
        library = f"`{results[0]['blas'].split('/')[-1].rstrip(')')}`" if "/" in results[0]["blas"] else "-"
        rows.append(f"| {CHOICES[name]} | {library} | "
                    f"{statistics.median(r['gflops'] for r in results):.1f} | {tps:.2f} | {ratio} |")
    threads = "" if args.threads is None else f" --threads {args.threads}"
    load = os.getloadavg()[0]
    header = (f"`python -m benchmarks.blas --rounds {args.rounds}{threads}` · {datetime.date.today()} · "
              f"{os.cpu_count()} cores, load average {load:.1f} at the end · MLX CPU · "
              f"SmolLM2-135M-Instruct float32 · greedy, 64 new tokens of \"{PROMPT}\" · medians of "
              f"{args.rounds} interleaved rounds, one process per BLAS and round")
    table = "\n".join(rows)
    print(f"\n{header}\n\n{table}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "blas.md"
    previous = out.read_text() if out.exists() else "# BLAS for MLX's Linux CPU backend\n"
    out.write_text(f"{previous}\n{header}\n\n{table}\n")  # appends: runs with other settings stay


if __name__ == "__main__":
    main()
