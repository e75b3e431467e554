"""T5 encoder-decoder in MLX (T5 v1.0, v1.1 and flan-t5), and ``T5Decoder``, which shows a decoding
loop a T5 plus one source sentence as a decoder-only model. See README.md."""

from t5.t5 import (
    Model,
    ModelArgs,
    T5Decoder,
    T5Tokenizer,
    convert_t5,
    is_encoder_decoder,
    is_t5_dir,
    load_t5,
    load_t5_model,
)

__all__ = [
    "Model",
    "ModelArgs",
    "T5Decoder",
    "T5Tokenizer",
    "convert_t5",
    "is_encoder_decoder",
    "is_t5_dir",
    "load_t5",
    "load_t5_model",
]
