"""Hides torch from the tests' subprocesses, as it is hidden on a user's machine: not installed.

torch is a test-only oracle (requirements-dev.txt). Where it is installed, ``import transformers``
(which mlx-lm's tokenizer imports) imports it too: 2.4 s of every ``main.py`` or server a test
starts, in a process unlike a user's. ``tests/conftest.py`` puts this folder first on the
subprocesses' PYTHONPATH, so Python imports this file at startup. An entry of None in
``sys.modules`` makes ``import torch`` raise ImportError and ``importlib.util.find_spec("torch")``
return None, which is how transformers asks.
"""

import sys

sys.modules["torch"] = None
