"""Models in, ready to run: ``load.py`` finds and loads one (the embedded default, a folder or a hub
id), ``conversion.py`` converts the embedded GGUF and T5 checkpoints, ``store.py`` keeps converted
models and other caches safe under concurrent first use and faults.

Nothing is imported here, so that ``store.cache_dir`` is at hand without MLX (flag checks use it).
"""
