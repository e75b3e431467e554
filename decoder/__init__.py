"""Speculative decoding for mlx-lm models: one verify-and-accept loop that every draft source
plugs into.

    from decoder import generate
    result = generate(model, tokenizer, "Hello", draft_sources=[...], max_tokens=64)

``loop.py`` holds the loop (``generate_step -> stream_generate -> generate``), ``draft.py`` the
draft and constraint protocols and the acceptance math, ``step.py`` one row's step, ``cache.py``
and ``kinds.py`` a cache whose rows roll back alone, ``processors.py`` mlx-lm's logits processors
over a pass's positions, ``sampling.py`` the target's distribution (temperature, truncations),
``cost.py`` the measured cost of a pass and what
drafts win.
"""

from .cache import Cache, CacheKindError, adopt, load_cache, make_cache
from .cost import PassCost
from .draft import (
    Constraint,
    ConstraintError,
    Draft,
    DraftSource,
    accept_draft,
    accept_sampled,
    mask_logits,
)
from .loop import GenerationResult, Response, generate, generate_step, stream_generate
from .processors import make_logits_processors, process_logits
from .sampling import Sampling, sampling_probs
from .step import TARGET, DecodingStats, SourceStats
from .text import TextStream, encode, eos_ids_of, plain_chat
