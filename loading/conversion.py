"""A GGUF file or a Hugging Face model -> an mlx-lm model directory (``convert``, ``convert_into``).

mlx-lm does the loading, casting, quantizing and saving; this file only adds the GGUF reader
(``read_gguf``, a renaming table and the tokenizer rebuilt from the metadata) and the layer cut.
Importing it does nothing else: the command line is convert.py, which loads a fast BLAS first.
"""

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

from loading.store import make_staging_dir, publish, removed_on_exit, sweep, write_checksums
from t5 import convert_t5, is_t5_dir

DTYPES = ("float32", "float16", "bfloat16")

# llama.cpp tensor names -> Hugging Face Llama names.
GGUF_TO_HF = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class ConversionError(ValueError):
    """A source the converter cannot handle (the message is shown to the user)."""


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{GGUF_TO_HF[parts[2]]}.{parts[3]}"
    return f"{GGUF_TO_HF[parts[0]]}.{parts[1]}"


def _unpermute_rotary(weight: mx.array, num_heads: int) -> mx.array:
    """llama.cpp interleaves each head's rotary halves; undo it for HF's layout."""
    out_dim, in_dim = weight.shape
    head_dim = out_dim // num_heads
    weight = weight.reshape(num_heads, head_dim // 2, 2, in_dim).swapaxes(1, 2)
    return weight.reshape(out_dim, in_dim)


def _meta(metadata: dict, key: str, default=None):
    value = metadata.get(key, default)
    return value.item() if isinstance(value, mx.array) else value


def read_gguf(gguf_path: str):
    """Read a Llama-family GGUF into (float weights with HF names, HF config, tokenizer)."""
    try:
        tensors, metadata = mx.load(gguf_path, return_metadata=True)
    except Exception as error:
        raise ConversionError(f"cannot read GGUF file {gguf_path}: {error}") from None
    arch = _meta(metadata, "general.architecture")
    if arch != "llama":
        raise ConversionError(
            f"{gguf_path} is a '{arch}' GGUF; only Llama-family GGUF files are supported"
        )
    if _meta(metadata, "tokenizer.ggml.model") != "gpt2":
        raise ConversionError(
            f"{gguf_path} has a non byte-level BPE tokenizer, which is not supported"
        )
    try:
        weights, config, tokenizer = _llama_from_gguf(tensors, metadata)
        mx.eval(weights)  # dequantize here, so that a malformed tensor is reported as one
    # missing keys, odd shapes, a broken vocabulary: the file is at fault
    except Exception as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConversionError(
            f"{gguf_path} is not a Llama GGUF this converter can read: {reason}"
        ) from None
    return weights, config, tokenizer


def _llama_from_gguf(tensors: dict, metadata: dict):
    num_heads = _meta(metadata, "llama.attention.head_count")
    num_kv_heads = _meta(metadata, "llama.attention.head_count_kv", num_heads)
    weights = {}
    for name, value in tensors.items():
        if name.endswith((".scales", ".biases")) or name.startswith("rope_freqs"):
            continue
        if value.dtype == mx.uint32:
            # mx.load hands Q4_0/Q4_1/Q8_0 blocks back as MLX quantized triples (group size 32);
            # the bit width differs per tensor (embeddings are often Q8_0), so derive it.
            base = name.rsplit(".", 1)[0]
            scales, biases = tensors[base + ".scales"], tensors[base + ".biases"]
            bits = value.shape[-1] * 32 // (scales.shape[-1] * 32)
            value = mx.dequantize(value, scales, biases, group_size=32, bits=bits)
        if name.endswith("attn_q.weight"):
            value = _unpermute_rotary(value, num_heads)
        elif name.endswith("attn_k.weight"):
            value = _unpermute_rotary(value, num_kv_heads)
        weights[_hf_name(name)] = value.astype(mx.float32)

    vocab = metadata["tokenizer.ggml.tokens"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": _meta(metadata, "llama.embedding_length"),
        "intermediate_size": _meta(metadata, "llama.feed_forward_length"),
        "num_hidden_layers": _meta(metadata, "llama.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "rms_norm_eps": _meta(metadata, "llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": _meta(metadata, "llama.rope.freq_base", 10000.0),
        "max_position_embeddings": _meta(metadata, "llama.context_length"),
        "vocab_size": len(vocab),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "bos_token_id": _meta(metadata, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta(metadata, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    return weights, config, gguf_tokenizer(metadata)


def gguf_tokenizer(metadata: dict):
    """Rebuild the byte-level BPE tokenizer from GGUF metadata with `tokenizers`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE({token: i for i, token in enumerate(vocab)}, merges))
    # StarCoder-style split (every digit alone) before the GPT-2 byte-level split.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    token_types = metadata["tokenizer.ggml.token_type"].tolist()
    control = [vocab[i] for i, kind in enumerate(token_types) if kind == 3]  # 3 = control
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in control]
    )

    def token(key):
        index = _meta(metadata, key)
        return None if index is None else vocab[index]

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
        chat_template=_meta(metadata, "tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def check_options(
    dtype: str = "float32",
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    num_layers: int = None,
):
    """Refuse options the conversion cannot honour, before any work."""
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype must be one of {', '.join(DTYPES)}")
    if num_layers is not None and num_layers < 1:
        raise ConversionError("--num-layers must be >= 1")
    if quantize:
        # A group size below 1 crashes MLX (SIGFPE); past that, ask MLX itself what it supports.
        if not 1 <= q_group_size <= 4096 or not 1 <= q_bits <= 32:
            raise ConversionError(
                f"cannot quantize with --q-bits {q_bits} --q-group-size {q_group_size}"
            )
        try:
            mx.eval(mx.quantize(mx.zeros((1, q_group_size)), group_size=q_group_size, bits=q_bits))
        except ValueError as error:
            reason = str(error).replace("[quantize] ", "")
            raise ConversionError(
                f"cannot quantize with --q-bits {q_bits} --q-group-size {q_group_size}: {reason}"
            ) from None


def convert(mlx_path: str, gguf: str = None, hf_path: str = None, **options) -> Path:
    """Write an mlx-lm model directory at ``mlx_path``, which must not exist.

    The directory appears whole, with its ``checksums.json``, or not at all: the
    work happens in a staging directory beside it, removed if anything fails.

    Args:
        mlx_path: The output directory.
        gguf, hf_path: The source: a GGUF file, or a local directory or Hugging Face repo.
        options: ``dtype``, ``quantize``, ``q_bits``, ``q_group_size``, ``num_layers`` (see
            convert.py).
    """
    output = Path(mlx_path)
    check_options(**options)
    if output.exists():
        raise ConversionError(f"{output} already exists; choose a new --mlx-path")
    sweep(output.parent)
    try:
        staging = make_staging_dir(output)
    except OSError as error:
        raise ConversionError(f"cannot write {output}: {error.strerror or error}") from None
    with removed_on_exit(staging):
        convert_into(staging, gguf=gguf, hf_path=hf_path, **options)
        write_checksums(staging)
        if not publish(staging, output):
            raise ConversionError(f"{output} appeared while converting; choose a new --mlx-path")
    return output


def convert_into(
    output: Path,
    gguf: str = None,
    hf_path: str = None,
    dtype: str = "float32",
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    num_layers: int = None,
):
    """Convert into the existing, empty directory ``output`` (see ``convert`` for the atomic
    version)."""
    from mlx_lm.utils import _download, quantize_model, save
    from tqdm import tqdm

    from loading.target import load_mlx_lm

    if (gguf is None) == (hf_path is None):
        raise ConversionError("give exactly one of --gguf and --hf-path")
    check_options(dtype, quantize, q_bits, q_group_size, num_layers)
    output = Path(output)
    # Converting takes a while: show the stage (on a terminal only).
    progress = tqdm(
        total=4,
        desc=f"Converting {Path(gguf or hf_path).name}",
        unit="step",
        disable=None,
        leave=False,
    )

    @contextmanager
    def stage(label):
        progress.set_postfix_str(label)
        yield
        progress.update()

    with progress:
        source = hf_path
        if gguf is not None:
            source = output / "gguf-source"
            _stage_gguf(gguf, source, stage)
        elif is_t5_dir(hf_path):
            if quantize or num_layers:
                raise ConversionError("--quantize and --num-layers are not supported for T5 models")
            with stage("converting T5"):
                return convert_t5(hf_path, output, dtype)

        with stage("loading"):
            try:
                source = _download(str(source))  # a local directory as is, a repo id downloaded
                model, tokenizer, config = load_mlx_lm(source, lazy=True)
            except Exception as error:
                raise ConversionError(
                    f"cannot load {source}: {str(error).splitlines()[0]}"
                ) from None

        with stage("casting"):
            if num_layers is not None:
                _keep_first_layers(model, config, num_layers)
            model.update(_cast(model.parameters(), getattr(mx, dtype)))
            config["torch_dtype"] = dtype
            # Early exit (--num-layers) feeds the MTP layer hidden states it was not trained on:
            # dropped.
            mtp = (
                None
                if num_layers is not None
                else convert_mtp(model, config, Path(source), getattr(mx, dtype))
            )
            if quantize:
                model, config = quantize_model(model, config, q_group_size, q_bits)
                if mtp is not None:  # as the target's layers are, so that a 4-bit conversion drafts
                    predicate = getattr(model, "quant_predicate", None)
                    quantize_model(mtp, {}, q_group_size, q_bits, quant_predicate=predicate)
        with stage("saving"):
            save(output, source, model, tokenizer, config)
            if mtp is not None:
                save_mtp(mtp, output)
        if gguf is not None:
            shutil.rmtree(source)
    _inline_chat_template(output)
    return output


def _stage_gguf(gguf: str, source: Path, stage):
    """Write the GGUF into ``source`` as a Hugging Face-style directory, so mlx-lm can take over."""
    source.mkdir()
    with stage("reading GGUF"):
        weights, config, tokenizer = read_gguf(gguf)
        mx.save_safetensors(str(source / "model.safetensors"), weights)
        del weights  # free them before mlx-lm loads the copy
    (source / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(source)
    _inline_chat_template(source)


def _keep_first_layers(model, config: dict, num_layers: int):
    """Early exit: keep the first ``num_layers`` layers; the final norm and head stay the same."""
    layers = model.model.layers
    if not 1 <= num_layers <= len(layers):
        raise ConversionError(f"--num-layers must be between 1 and {len(layers)}")
    model.model.layers = layers[:num_layers]
    config["num_hidden_layers"] = num_layers


def convert_mtp(model, config: dict, source: Path, dtype):
    """The MTP module of a Hugging Face checkpoint in mlx-lm's layout and ``dtype``, kept beside the
    target (mtp/model.py); None for a model without MTP weights."""
    from mtp.model import MTPError, NoMTPWeights, build_mtp, cast, hf_to_module, read_hf_mtp

    try:
        weights = read_hf_mtp(source, config)
        if not weights:
            return None
        mtp = build_mtp(model, config)
        mtp.load_weights(list(hf_to_module(model, config, weights).items()), strict=True)
    except NoMTPWeights:
        return None
    except (MTPError, ValueError) as error:
        raise ConversionError(
            f"the MTP weights of {source} cannot be converted ({str(error).splitlines()[0]})"
        ) from None
    cast(mtp, dtype, getattr(model, "cast_predicate", None))
    return mtp


def save_mtp(mtp, output: Path):
    """Beside the target's weights, in a file of its own: mlx-lm reads only
    ``model*.safetensors``."""
    from mlx.utils import tree_flatten

    from mtp.model import MTP_FILE

    mx.save_safetensors(str(output / MTP_FILE), dict(tree_flatten(mtp.parameters())))


def _inline_chat_template(path: Path):
    """Also keep the chat template in tokenizer_config.json, where older loaders look."""
    template_file, config_file = path / "chat_template.jinja", path / "tokenizer_config.json"
    if template_file.exists() and config_file.exists():
        config = json.loads(config_file.read_text())
        config.setdefault("chat_template", template_file.read_text())
        config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False))


def _cast(tree, dtype):
    from mlx.utils import tree_map

    return tree_map(lambda v: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v, tree)
