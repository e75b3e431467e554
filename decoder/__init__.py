"""Speculative decoding for mlx-lm models: one verify-and-accept loop that every draft source
plugs into. What each module holds: README.md.

    from decoder import generate
    result = generate(model, tokenizer, "Hello", draft_sources=[...], max_tokens=64)
"""

from .accept import accept_draft, accept_sampled, accept_tree
from .cache import Cache, CacheKindError, adopt, make_cache
from .cache_file import load_cache
from .constrain import mask_logits
from .draft import Constraint, ConstraintError, Draft, Drafter, DraftRequest, DraftSource
from .loop import GenerationResult, Response, generate, generate_step, stream_generate
from .pass_cost import PassCost
from .processors import make_logits_processors, process_logits
from .row import TARGET, DecodingStats, SourceStats
from .sampling import Sampling, SamplingError
from .text import TextStream, encode, eos_ids_of, plain_chat
from .tree_pass import enable_trees
