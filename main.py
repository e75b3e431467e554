"""Generate text with the shared verify-and-accept loop and any mix of draft sources.

python main.py                                   # embedded SmolLM2-135M-Instruct
python main.py --prompt-file code.txt --prompt-lookup --color
python main.py --prompt "Give me a date" --regex '\\d{4}-\\d{2}-\\d{2}' --color
python main.py --prompt "A user as JSON" --json-schema schema.json --color
python main.py --prompt "Play chess" --grammar tests/data/gbnf/chess.gbnf --max-tokens 40
--color python main.py --model target --draft-model draft --color --json
python main.py --model Qwen3-Next-DIR --mtp --num-draft 2 --color
"""

import argparse
import json
import signal
import sys

from cli import (
    CLOSED_PIPE_STATUS,
    CliError,
    Parser,
    check_finite,
    check_text_argument,
    discard_stdout,
    read_text_file,
    read_text_stream,
    reopen_closed_std_streams,
    writing_output,
)
from cli.constraints import add_arguments as add_constraint_arguments
from cli.constraints import check as check_constraint_arguments
from cli.flags import add_arguments as add_source_arguments
from cli.flags import add_prompt_store_arguments, add_sampling_arguments, check_sampling
from cli.flags import check as check_source_arguments
from loading import fast_blas

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."
DEFAULT_QUANTIZED_KV_START = 5000  # mlx_lm.generate's: short prompts keep a float cache

# One colour per draft source; tokens the target chose itself stay uncoloured. Reasoning is dimmed.
COLORS = {
    "regex": "\033[36m",
    "grammar": "\033[34m",
    "prompt_lookup": "\033[32m",
    "history_lookup": "\033[32m",
    "draft_model": "\033[35m",
    "draft_head": "\033[33m",
    "mtp": "\033[91m",
    "thinking": "\033[36m",
}
RESET, DIM = "\033[0m", "\033[2m"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(description="Fast, structured generation with MLX.")
    parser.add_argument(
        "--model",
        default=None,
        help="Local mlx-lm/T5 directory or Hugging Face repo "
        "(default: embedded SmolLM2-135M-Instruct).",
    )
    parser.add_argument(
        "--prompt", default=None, help="The prompt (default: stdin if piped, else a demo question)."
    )
    parser.add_argument("--prompt-file", default=None, help="Read the prompt from this file.")
    parser.add_argument("--system", default=None, help="System message for the chat template.")
    parser.add_argument(
        "--no-chat-template", action="store_true", help="Use the prompt as raw text."
    )
    parser.add_argument(
        "--max-tokens", type=int, default=256, help="Most tokens to generate (default: 256)."
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="Random seed for sampling (default: 0)."
    )
    parser.add_argument(
        "--color",
        nargs="?",
        const="auto",
        default="never",
        choices=["auto", "always", "never"],
        help="Colour tokens by draft source; bare --color colours only on a terminal.",
    )
    parser.add_argument("--verbose", action="store_true", help="Print per-source statistics.")
    parser.add_argument(
        "--json", action="store_true", help="Print one JSON object instead of streaming text."
    )
    add_sampling_arguments(parser)  # --temp, --top-p, --top-k, ..., --logit-bias
    # --prompt-lookup, --draft-model, --draft-head, ..., --shard (shared with the server)
    add_source_arguments(parser)
    # --regex, --json-schema, --grammar, --thinking-budget, ...
    add_constraint_arguments(parser)
    add_prompt_store_arguments(parser)  # --prompt-cache-dir, --prompt-cache-disk-bytes
    return parser


def validate(args):
    check_finite(args)
    for flag in ("prompt", "system"):
        check_text_argument(getattr(args, flag), f"--{flag}")
    if not 0 <= args.seed < 2**64:
        raise CliError("--seed must be in [0, 2**64)")
    if args.max_tokens < 0:
        raise CliError("--max-tokens must be >= 0")
    check_sampling(args)  # args.sampling: the flags' decoder.Sampling
    if args.quantized_kv_start is None:
        args.quantized_kv_start = DEFAULT_QUANTIZED_KV_START
    check_source_arguments(args)
    if args.prompt is not None and args.prompt_file is not None:
        raise CliError("give --prompt or --prompt-file, not both")
    check_constraint_arguments(args)  # last: it compiles the pattern


def read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        return read_text_file(args.prompt_file, "prompt file")
    if sys.stdin is not None and not sys.stdin.isatty():
        try:
            text = read_text_stream(sys.stdin.buffer, "stdin")
        except OSError as error:
            raise CliError(
                f"cannot read the prompt from stdin: {error.strerror or error}"
            ) from None
        if text.strip():
            return text
    return DEFAULT_PROMPT


def build_run(args, session=None):
    """Load models and draft sources; returns (target, tokenizer, prompt_tokens, loop kwargs).

    ``args``: ``validate``d (it builds the ``Sampling`` and compiles the constraint's pattern).
    ``session`` (from ``distributed.start``) shards the target over the launched ranks.
    """
    from cli import constraints
    from cli.flags import open_prompt_store
    from cli.sources import draft_sources
    from decoder.cache import check_quantizable
    from decoder.row import DecodingStats
    from decoder.text import encode, output_size
    from decoder.tree_pass import enable_trees
    from loading.load import context_length, load_model
    from t5 import T5Decoder, is_encoder_decoder

    text = read_prompt(args)  # bad prompt bytes fail before the model loads
    model, tokenizer, path = load_model(args.model, lazy=session is not None)
    if session is not None:
        if is_encoder_decoder(model):
            raise CliError("a T5 target cannot be sharded; run it in one process")
        model = session.shard(model, args.shard)
    encoder_input = None
    if is_encoder_decoder(model):  # the encoder reads the prompt, the decoder starts fresh
        encoder_input = tokenizer.encode(text)
        model = T5Decoder(model, encoder_input)
        prompt = model.prompt_tokens()
    elif args.no_chat_template:
        prompt = tokenizer.encode(text)
    else:
        prompt = encode(
            tokenizer,
            text,
            system=args.system,
            **({"enable_thinking": False} if args.no_thinking else {}),
        )
    if not prompt:
        raise CliError("the prompt is empty")
    limit = context_length(path)
    if limit is not None and len(prompt) + 1 > limit:
        raise CliError(
            f"the prompt has {len(prompt)} tokens; the model's context is {limit} tokens"
        )
    max_tokens = args.max_tokens if limit is None else min(args.max_tokens, limit - len(prompt))

    vocab_size = output_size(model, tokenizer)
    constraint, forced = constraints.build(
        args, tokenizer, vocab_size, prompt, encoder_input is not None
    )
    model, drafts = draft_sources(args, model, tokenizer, encoder_input, session)
    if args.kv_bits is not None and encoder_input is None:  # CacheKindError, in one line
        check_quantizable(model, args.kv_group_size)
    if args.tree_nodes and (forced or drafts):  # the rope modules take a tree's positions
        enable_trees(model)
    kwargs = dict(
        draft_sources=forced + drafts,
        constraint=constraint,
        **sampling_kwargs(args, tokenizer, vocab_size),
        max_tokens=max_tokens,
        stats=DecodingStats(),
        tree_nodes=args.tree_nodes,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        quantized_kv_start=args.quantized_kv_start,
    )
    if session is not None:  # every rank must fit the same cost, or their drafts differ
        kwargs["pass_cost"] = session.pass_cost()
    if args.prompt_cache_dir is not None:
        if encoder_input is not None:
            raise CliError("--prompt-cache-dir: a T5 target's prompt is its encoder's input")
        kwargs["prompt_store"] = open_prompt_store(args, model, session)
    return model, tokenizer, prompt, kwargs


def sampling_kwargs(args, tokenizer, vocab_size: int) -> dict:
    """The loop's ``sampling`` (the flags', ``validate`` built it) and logits processors; XTC
    never removes a newline or EOS, as in mlx_lm.server."""
    from dataclasses import replace

    from cli.flags import processor_options
    from decoder.processors import make_logits_processors
    from decoder.text import eos_ids_of

    outside = [token for token in args.logit_bias or {} if token >= vocab_size]
    if outside:
        raise CliError(
            f"--logit-bias: token id {outside[0]} is outside the vocabulary ({vocab_size})"
        )
    sampling = args.sampling
    if sampling.xtc_probability > 0:  # what only the tokenizer knows
        special = tokenizer.encode("\n", add_special_tokens=False) + sorted(eos_ids_of(tokenizer))
        sampling = replace(sampling, xtc_special_tokens=special)
    processors = make_logits_processors(**processor_options(args))
    return dict(sampling=sampling, logits_processors=processors)


def print_stats(result, verbose: bool, use_color: bool):
    stats = result.stats
    if use_color and stats.sources:
        legend = " ".join(f"{COLORS.get(name, '')}{name}{RESET}" for name in stats.sources)
        print(f"legend: {legend} (uncoloured: target)")
    print(result.report())
    if verbose:
        for name, source in stats.sources.items():
            summary = source.summary()
            by_position = ", ".join(f"{r:.2f}" for r in summary["acceptance_by_position"][:16])
            print(
                f"  {name}: proposed {summary['proposed']}, accepted {summary['accepted']} "
                f"({summary['acceptance_rate']:.1%}), "
                f"mean accepted length {summary['mean_accepted_length']:.2f}, "
                f"acceptance by position [{by_position}]"
            )


def run(args):
    """Generate and print as ``args`` say; returns the ``GenerationResult``."""
    import mlx.core as mx

    import distributed
    from cli.constraints import thinking_budget
    from constrained.thinking import CLOSING, OPENING, THINKING, ThinkingConstraint, thinking_of
    from decoder import generate

    validate(args)
    # None unless launched
    session = distributed.start(args.dist_timeout, fast_blas.set_num_threads)
    mx.random.seed(args.seed)
    model, tokenizer, prompt, kwargs = build_run(args, session)
    use_color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    thinking = thinking_of(tokenizer, prompt, thinking_budget(args))
    # follows where the text is
    block = (
        None if thinking is None else ThinkingConstraint(thinking.markers, 0, phase=thinking.phase)
    )

    def show(response):
        color = COLORS.get(response.source, "") if use_color else ""
        if block is not None:
            inside = block.state.phase in (OPENING, THINKING, CLOSING)
            block.advance([response.token])
            color = (
                DIM + color
                if use_color and (inside or block.state.phase in (OPENING, THINKING))
                else color
            )
        print(f"{color}{response.text}{RESET if color else ''}", end="", flush=True)

    with writing_output():
        with distributed.reporting_faults():
            result = generate(
                model, tokenizer, prompt, on_token=None if args.json else show, **kwargs
            )
        # the prompt's new blocks on disk before exiting (the target's and a draft model's)
        drafters = [source.drafter for source in kwargs["draft_sources"] if source.drafter]
        for store in [kwargs.get("prompt_store")] + [d.prompt_store for d in drafters]:
            if store is not None:
                store.close()
        if args.json:
            reasoning, answer = (
                (None, result.text) if thinking is None else thinking.split(result.text)
            )
            print(json.dumps({**result.to_json(), "reasoning": reasoning, "answer": answer}))
        else:
            print()
            print_stats(result, args.verbose, use_color)
    if args.lookup_history is not None and result.tokens and (session is None or session.rank == 0):
        from cli.flags import history_path
        from prompt_lookup.history import append_history

        # after the output: a slow disk never delays it
        append_history(history_path(args), [result.tokens])
    return result


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Python next runs: cleanup and the one line are those of Ctrl-C."""


def terminate(signum, _frame):
    raise Terminated(signum)


def main():
    reopen_closed_std_streams()
    args = build_parser().parse_args()
    fast_blas.load()  # before anything imports mlx.core (Linux: MLX's own BLAS is far slower)
    from decoder.cache import CacheKindError
    from decoder.draft import ConstraintError
    from distributed import DistributedError
    from draft_model import VocabularyMismatch
    from loading.conversion import ConversionError
    from loading.load import ModelError
    from mtp.model import NoMTPWeights

    errors = (
        CliError,
        ModelError,
        ConversionError,
        VocabularyMismatch,
        ConstraintError,
        DistributedError,
    )
    try:
        from constrained import RegexError
        from constrained.grammar import GrammarError

        errors += (RegexError, GrammarError)
    except ImportError:
        pass
    # leave a caller's handler (or SIG_IGN) alone
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, terminate)
    try:
        run(args)
    # a cache drafts cannot roll back in, or no MTP layers
    except (CacheKindError, NoMTPWeights) as error:
        sys.stderr.write(f"error: not supported: {error}\n")
        sys.exit(2)
    except errors as error:
        sys.stderr.write(f"error: {error}\n")
        sys.exit(1)
    except BrokenPipeError:
        # The reader left (`| head`): stop quietly, as Unix tools do.
        discard_stdout()
        sys.exit(CLOSED_PIPE_STATUS)
    except OSError as error:  # the system refused something (permissions, a full disk): say what
        where = f": {error.filename}" if error.filename else ""
        sys.stderr.write(f"error: {error.strerror or error}{where}\n")
        sys.exit(1)
    # Ctrl-C or SIGTERM: exit status 128 + the signal, as a shell reports
    except KeyboardInterrupt as error:
        sys.stderr.write("interrupted\n")
        sys.exit(128 + (error.args[0] if isinstance(error, Terminated) else signal.SIGINT))


if __name__ == "__main__":
    main()
