"""T5 encoder-decoder in MLX (T5 v1.0, T5 v1.1 and flan-t5 checkpoints).

The model knows nothing about decoding; `T5Decoder` makes a model plus one source
sentence look like a decoder-only mlx-lm model to a generation loop.
"""

import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import BaseModelArgs
from mlx_lm.models.cache import KVCache

# feed_forward_proj -> activation; transformers runs "gated-gelu" with the tanh
# approximation (gelu_new), which is nn.gelu_approx.
ACTIVATIONS = {
    "relu": nn.relu,
    "gelu": nn.gelu,
    "gated-gelu": nn.gelu_approx,
    "gated-silu": nn.silu,
}


@dataclass
class ModelArgs(BaseModelArgs):
    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_decoder_layers: Optional[int] = None
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"
    tie_word_embeddings: bool = True
    # Written by transformers >= 5, which always sets tie_word_embeddings=true.
    scale_decoder_outputs: Optional[bool] = None
    decoder_start_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 0

    def __post_init__(self):
        if self.feed_forward_proj not in ACTIVATIONS:
            raise ValueError(
                f"unsupported feed_forward_proj {self.feed_forward_proj!r}; "
                f"expected one of {', '.join(ACTIVATIONS)}"
            )
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_layers
        if self.scale_decoder_outputs is None:
            self.scale_decoder_outputs = self.tie_word_embeddings


def relative_position_bucket(relative_position, bidirectional, num_buckets, max_distance):
    """Map key_position - query_position to one of `num_buckets` buckets.

    Half the buckets are exact offsets, the rest log-spaced up to
    `max_distance`; the causal decoder only sees offsets <= 0.
    """
    buckets = 0
    if bidirectional:
        num_buckets //= 2
        buckets = (relative_position > 0).astype(mx.int32) * num_buckets
        relative_position = mx.abs(relative_position)
    else:
        relative_position = -mx.minimum(relative_position, 0)
    max_exact = num_buckets // 2
    # Same operation order as transformers so float rounding picks the same bucket.
    log_ratio = mx.log(relative_position.astype(mx.float32) / max_exact)
    large = max_exact + (
        log_ratio / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).astype(mx.int32)
    large = mx.minimum(large, num_buckets - 1)
    return buckets + mx.where(relative_position < max_exact, relative_position, large)


class RelativePositionBias(nn.Module):
    def __init__(self, args: ModelArgs, bidirectional: bool):
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets = args.relative_attention_num_buckets
        self.max_distance = args.relative_attention_max_distance
        self.embedding = nn.Embedding(self.num_buckets, args.num_heads)

    def __call__(self, query_length: int, key_length: int, offset: int = 0):
        """Additive bias (1, heads, query_length, key_length) for queries at
        positions offset..offset+query_length-1; causal when not bidirectional."""
        query_positions = mx.arange(offset, offset + query_length)[:, None]
        key_positions = mx.arange(key_length)[None]
        buckets = relative_position_bucket(
            key_positions - query_positions, self.bidirectional, self.num_buckets, self.max_distance
        )
        bias = self.embedding(buckets)
        if not self.bidirectional:
            future = (key_positions > query_positions)[..., None]
            bias = mx.where(future, mx.array(-mx.inf, bias.dtype), bias)
        return bias.transpose(2, 0, 1)[None]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads = args.num_heads
        inner_dim = args.num_heads * args.d_kv
        self.q = nn.Linear(args.d_model, inner_dim, bias=False)
        self.k = nn.Linear(args.d_model, inner_dim, bias=False)
        self.v = nn.Linear(args.d_model, inner_dim, bias=False)
        self.o = nn.Linear(inner_dim, args.d_model, bias=False)

    def split_heads(self, x):
        B, L, _ = x.shape
        return x.reshape(B, L, self.num_heads, -1).transpose(0, 2, 1, 3)

    def keys_values(self, x) -> Tuple[mx.array, mx.array]:
        return self.split_heads(self.k(x)), self.split_heads(self.v(x))

    def __call__(self, x, keys, values, bias=None):
        B, L, _ = x.shape
        queries = self.split_heads(self.q(x))
        # T5 folds 1/sqrt(d_kv) into the initialization of q, hence scale=1.
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=1.0, mask=bias)
        return self.o(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DenseReluDense(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.act = ACTIVATIONS[args.feed_forward_proj]
        self.gated = args.feed_forward_proj.startswith("gated-")
        if self.gated:
            self.wi_0 = nn.Linear(args.d_model, args.d_ff, bias=False)
            self.wi_1 = nn.Linear(args.d_model, args.d_ff, bias=False)
        else:
            self.wi = nn.Linear(args.d_model, args.d_ff, bias=False)
        self.wo = nn.Linear(args.d_ff, args.d_model, bias=False)

    def __call__(self, x):
        if self.gated:
            return self.wo(self.act(self.wi_0(x)) * self.wi_1(x))
        return self.wo(self.act(self.wi(x)))


class EncoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        eps = args.layer_norm_epsilon
        self.self_attention = Attention(args)
        self.self_attention_norm = nn.RMSNorm(args.d_model, eps=eps)
        self.mlp = DenseReluDense(args)
        self.mlp_norm = nn.RMSNorm(args.d_model, eps=eps)

    def __call__(self, x, bias):
        h = self.self_attention_norm(x)
        x = x + self.self_attention(h, *self.self_attention.keys_values(h), bias)
        return x + self.mlp(self.mlp_norm(x))


class DecoderLayer(EncoderLayer):
    """An encoder layer that also attends to the encoder output, between its two blocks."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.cross_attention = Attention(args)
        self.cross_attention_norm = nn.RMSNorm(args.d_model, eps=args.layer_norm_epsilon)

    def __call__(self, x, bias, memory, cache):
        h = self.self_attention_norm(x)
        keys, values = cache.update_and_fetch(*self.self_attention.keys_values(h))
        x = x + self.self_attention(h, keys, values, bias)
        x = x + self.cross_attention(self.cross_attention_norm(x), *memory)
        return x + self.mlp(self.mlp_norm(x))


class Encoder(nn.Module):
    def __init__(self, args: ModelArgs, layers: list = None, bidirectional: bool = True):
        super().__init__()
        self.position_bias = RelativePositionBias(args, bidirectional=bidirectional)
        self.layers = (
            [EncoderLayer(args) for _ in range(args.num_layers)] if layers is None else layers
        )
        self.final_norm = nn.RMSNorm(args.d_model, eps=args.layer_norm_epsilon)

    def __call__(self, x):
        # Only the first layer owns a bias table; every layer reuses its output.
        bias = self.position_bias(x.shape[1], x.shape[1])
        for layer in self.layers:
            x = layer(x, bias)
        return self.final_norm(x)


class Decoder(Encoder):
    """The encoder's stack with decoder layers, whose position biases look only back."""

    def __init__(self, args: ModelArgs):
        super().__init__(
            args, [DecoderLayer(args) for _ in range(args.num_decoder_layers)], bidirectional=False
        )

    def __call__(self, x, memory, cache):
        # New tokens sit at offset..offset+T-1 and see keys 0..offset+T-1, so a
        # block of draft tokens gets exactly the biases of one-at-a-time decoding.
        offset, num_new = cache[0].offset, x.shape[1]
        bias = self.position_bias(num_new, offset + num_new, offset)
        for layer, layer_memory, layer_cache in zip(self.layers, memory, cache):
            x = layer(x, bias, layer_memory, layer_cache)
        return self.final_norm(x)


# Hugging Face name -> MLX name, applied in order; conversion is this table and a
# dtype cast. The last `block.*.layer_norm` left is the feed-forward norm.
_HF_RENAMES = [
    (r"block\.0\.layer\.0\.SelfAttention\.relative_attention_bias", "position_bias.embedding"),
    (r"block\.(\d+)\.layer\.0\.SelfAttention", r"layers.\1.self_attention"),
    (r"block\.(\d+)\.layer\.0\.layer_norm", r"layers.\1.self_attention_norm"),
    (r"block\.(\d+)\.layer\.1\.EncDecAttention", r"layers.\1.cross_attention"),
    (r"decoder\.block\.(\d+)\.layer\.1\.layer_norm", r"decoder.layers.\1.cross_attention_norm"),
    (r"block\.(\d+)\.layer\.\d\.DenseReluDense", r"layers.\1.mlp"),
    (r"block\.(\d+)\.layer\.\d\.layer_norm", r"layers.\1.mlp_norm"),
    (r"final_layer_norm", "final_norm"),
]


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.shared = nn.Embedding(args.vocab_size, args.d_model)
        self.encoder = Encoder(args)
        self.decoder = Decoder(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.d_model, args.vocab_size, bias=False)

    def encode(self, input_ids: mx.array) -> mx.array:
        """Encode unpadded source ids (B, S) into (B, S, d_model)."""
        return self.encoder(self.shared(input_ids))

    def cross_attention_memory(self, encoder_output: mx.array):
        """Project the encoder output once into each decoder layer's
        cross-attention (keys, values); pass the list as `memory` to `decode`."""
        return [layer.cross_attention.keys_values(encoder_output) for layer in self.decoder.layers]

    def decode(self, decoder_ids: mx.array, memory, cache=None) -> mx.array:
        """Logits (B, T, vocab) for decoder ids (B, T) following the cache's tokens.

        Args:
            decoder_ids: New decoder tokens; the first call starts with `decoder_start_token_id`.
            memory: Output of `cross_attention_memory`.
            cache: From `make_cache`; None decodes `decoder_ids` from scratch.
        """
        cache = self.make_cache() if cache is None else cache
        x = self.decoder(self.shared(decoder_ids), memory, cache)
        if self.args.scale_decoder_outputs:
            x = x * self.args.d_model**-0.5
        if self.args.tie_word_embeddings:
            return self.shared.as_linear(x)
        return self.lm_head(x)

    def make_cache(self) -> List[KVCache]:
        return [KVCache() for _ in self.decoder.layers]

    def sanitize(self, weights):
        """Rename Hugging Face weights to this model's names; MLX names pass through."""
        if "encoder.final_layer_norm.weight" not in weights:
            return weights
        # Copies of `shared`, and a cross-attention bias table T5 never uses.
        dropped = ("embed_tokens.", "EncDecAttention.relative_attention_bias")
        if self.args.tie_word_embeddings:
            dropped += ("lm_head.",)
        weights = {k: v for k, v in weights.items() if not any(d in k for d in dropped)}
        for pattern, replacement in _HF_RENAMES:
            weights = {re.sub(pattern, replacement, k): v for k, v in weights.items()}
        return weights


class T5Decoder:
    """A T5 and one source sentence, seen as a decoder-only mlx-lm model.

    Cross-attention keys/values are fixed by the source, so they are computed
    here once and kept out of the cache: a loop may then trim every cache
    entry (`trim_prompt_cache`) without touching them.
    """

    def __init__(self, model: Model, encoder_input_ids: List[int]):
        self.model = model
        self.args = model.args
        encoder_output = model.encode(mx.array([encoder_input_ids], mx.int32))
        self.memory = model.cross_attention_memory(encoder_output)
        # Run the encoder now, so the first decoder step's timing is the decoder's.
        mx.eval(self.memory)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        return self.model.decode(inputs, self.memory, cache)

    def make_cache(self) -> List[KVCache]:
        return self.model.make_cache()

    def parameters(self):
        return self.model.parameters()

    def prompt_tokens(self) -> List[int]:
        return [self.args.decoder_start_token_id]


class T5Tokenizer:
    """The sentencepiece tokenizer of T5 (`spiece.model`), as transformers uses it."""

    def __init__(self, model_file, eos_token_id: int = 1, pad_token_id: int = 0):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.eos_token_ids = {eos_token_id}
        self.vocab_size = self.sp.get_piece_size()

    def encode(self, text: str) -> List[int]:
        # The encoder was trained on inputs that end with </s>.
        return self.sp.encode(text) + [self.eos_token_id]

    def get_vocab(self) -> dict:
        """piece -> id, the same shape as a Hugging Face tokenizer's vocabulary."""
        return {self.sp.id_to_piece(i): i for i in range(self.vocab_size)}

    def decode(self, ids: List[int]) -> str:
        # Ids past the sentencepiece vocabulary are T5's <extra_id_*> sentinels.
        special = (self.pad_token_id, self.eos_token_id)
        return self.sp.decode([i for i in ids if i not in special and i < self.vocab_size])


def is_encoder_decoder(model) -> bool:
    """Whether ``model`` is a T5 (as ``load_t5`` returns it): the encoder reads the prompt and the
    decoder starts fresh, so it needs ``T5Decoder`` before a decoding loop can run it."""
    return isinstance(model, Model)


def is_t5_dir(path) -> bool:
    config = Path(path) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == "t5"


def load_t5_model(path) -> Model:
    """Load a T5 from a directory with config.json and *.safetensors, in
    Hugging Face names or as written by `convert_t5`."""
    path = Path(path)
    if not is_t5_dir(path):
        raise ValueError(f"{path} is not a T5 directory (no config.json with model_type 't5')")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no *.safetensors in {path}; re-save the checkpoint with save_pretrained."
        )
    args = ModelArgs.from_dict(json.loads((path / "config.json").read_text()))
    weights = {name: w for file in files for name, w in mx.load(str(file)).items()}
    if args.tie_word_embeddings and "lm_head.weight" in weights:
        # transformers 5 writes tie_word_embeddings=true for every T5 and unties
        # a head that differs from the embedding (flan-t5); do the same.
        head, embedding = weights["lm_head.weight"], weights["shared.weight"]
        args.tie_word_embeddings = mx.array_equal(head, embedding).item()
    model = Model(args)
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())
    return model


def load_t5(path) -> Tuple[Model, Optional[T5Tokenizer]]:
    """Load model and tokenizer; the tokenizer is None without spiece.model."""
    model, spiece = load_t5_model(path), Path(path) / "spiece.model"
    if not spiece.is_file():
        return model, None
    return model, T5Tokenizer(spiece, model.args.eos_token_id, model.args.pad_token_id)


def convert_t5(hf_path, mlx_path, dtype: str = "bfloat16") -> Path:
    """Write an MLX copy of a Hugging Face T5 (config.json, model.safetensors in
    MLX names, spiece.model) that `load_t5` reads back.

    bfloat16 by default: T5 v1.1 activations are known to overflow float16.
    """
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, not {dtype!r}")
    model = load_t5_model(hf_path)
    model.set_dtype(getattr(mx, dtype))
    mlx_path = Path(mlx_path)
    mlx_path.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(mlx_path / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((Path(hf_path) / "config.json").read_text())
    config["tie_word_embeddings"] = model.args.tie_word_embeddings
    config["scale_decoder_outputs"] = model.args.scale_decoder_outputs
    (mlx_path / "config.json").write_text(json.dumps(config, indent=2))
    if (Path(hf_path) / "spiece.model").is_file():
        shutil.copy(Path(hf_path) / "spiece.model", mlx_path / "spiece.model")
    return mlx_path
