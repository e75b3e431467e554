"""Benchmarks: ``python -m benchmarks.<name>``.

Every entry point is a module of this package, so loading a fast BLAS here,
before any of them imports mlx.core, covers them all.
"""

import fast_blas

fast_blas.load()
