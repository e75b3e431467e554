"""A prompt cache on disk: a model's prompt caches in blocks under chained keys (``PromptStore``),
on named arrays in files (``BlockStore``)."""

from prompt_store.block_store import BlockStore, chain_keys
from prompt_store.identity import model_identity
from prompt_store.prompt_store import BLOCK_TOKENS, PromptStore

__all__ = ["BLOCK_TOKENS", "BlockStore", "PromptStore", "chain_keys", "model_identity"]
