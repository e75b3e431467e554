"""Convert a GGUF file or a Hugging Face model into an mlx-lm model directory.

    python convert.py --gguf model.gguf --mlx-path mlx_model
    python convert.py --hf-path HuggingFaceTB/SmolLM2-135M-Instruct --mlx-path mlx_model -q
    python convert.py --gguf model.gguf --mlx-path draft --num-layers 8   # early-exit self-draft

The command line only; the reader and the conversion are in loading/conversion.py.
"""

import sys
from pathlib import Path

from loading import fast_blas

fast_blas.load()  # before mlx.core, so `python convert.py` gets a fast BLAS too (no-op when loaded)

from cli import Parser  # noqa: E402
from loading.conversion import DTYPES, ConversionError, convert  # noqa: E402


def main():
    parser = Parser(description="Convert a GGUF or Hugging Face model to an mlx-lm directory.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", help="Path to a Llama-family GGUF file.")
    source.add_argument("--hf-path", help="Local directory or Hugging Face repo id.")
    parser.add_argument("--mlx-path", required=True, help="Output directory (must not exist).")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="Weight dtype (default: float32)."
    )
    parser.add_argument("-q", "--quantize", action="store_true", help="Quantize the weights.")
    parser.add_argument(
        "--q-bits", type=int, default=4, help="Bits per quantized weight (default: 4)."
    )
    parser.add_argument(
        "--q-group-size", type=int, default=64, help="Quantization group size (default: 64)."
    )
    parser.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="Keep only the first N decoder layers (an early-exit self-draft).",
    )
    args = parser.parse_args()
    try:
        if args.gguf is not None and not Path(args.gguf).is_file():
            if Path(args.gguf).is_dir():
                raise ConversionError(f"{args.gguf} is a directory, not a GGUF file")
            raise ConversionError(f"GGUF file not found: {args.gguf}")
        output = convert(
            args.mlx_path,
            gguf=args.gguf,
            hf_path=args.hf_path,
            dtype=args.dtype,
            quantize=args.quantize,
            q_bits=args.q_bits,
            q_group_size=args.q_group_size,
            num_layers=args.num_layers,
        )
    except ConversionError as error:
        sys.exit(f"error: {error}")
    except OSError as error:  # e.g. the disk filled up; the staging directory is gone already
        sys.exit(
            f"error: {error.strerror or error}" + (f": {error.filename}" if error.filename else "")
        )
    except KeyboardInterrupt:
        sys.exit(130)
    print(f"Saved {output}")


if __name__ == "__main__":
    main()
