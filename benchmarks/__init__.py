"""Benchmarks: ``python -m benchmarks.<name>``.

``python -m benchmarks.x`` imports this package before the module, so loading a fast BLAS
here, before anything imports mlx.core, covers every entry point. The processes they start
(distributed's ranks, hostile_inputs' cases, the servers of benchmarks.server) load it themselves.
"""

from loading import fast_blas

fast_blas.load()
