"""Serve the model over three HTTP APIs: OpenAI chat completions, OpenAI Responses and Anthropic
Messages.

    python -m server                                  # embedded SmolLM2-135M-Instruct on
    127.0.0.1:8080 python -m server --prompt-lookup --port 8000 --api-key secret
    python -m server --model DIR --draft-model DRAFT_DIR
    python -m server --model DIR --mtp                # the model's own MTP layers, one request at a
    time

Endpoints: GET /v1/models, POST /v1/chat/completions, /v1/completions, /v1/responses (OpenAI),
POST /v1/messages, /v1/messages/count_tokens (Anthropic); see docs/server.md.
"""

import argparse
import asyncio
import os
import socket
import sys

from cli import CliError, Parser, flags
from loading import fast_blas


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        description="An OpenAI-compatible server for fast, structured generation with MLX."
    )
    parser.add_argument(
        "--model",
        default=None,
        help="Local mlx-lm directory or Hugging Face repo (default: embedded "
        "SmolLM2-135M-Instruct).",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="Address to bind (default: 127.0.0.1, this machine only).",
    )
    parser.add_argument(
        "--port", type=int, default=8080, help="Port to bind (default: 8080; 0 picks a free one)."
    )
    parser.add_argument(
        "--api-key", default=None, help="Require 'Authorization: Bearer KEY' on every request."
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=512,
        help="max_tokens for requests that do not set it (default: 512).",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help="Requests decoded together (continuous batching; 1: one at a time; default: 8).",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=8,
        help="Requests waiting beyond the running ones; more get HTTP 503 (default: 8).",
    )
    parser.add_argument(
        "--prompt-cache-bytes",
        type=int,
        default=2**30,
        help="KV entries kept of earlier conversations, least recently used out (default: 1 GiB).",
    )
    parser.add_argument(
        "--stored-responses",
        type=int,
        default=256,
        help="Responses API answers kept for previous_response_id, oldest out (default: 256).",
    )
    parser.add_argument(
        "--effort-budgets",
        default="",
        metavar="EFFORT=TOKENS,...",
        help="Think-block budgets of the effort levels, over the table in docs/server.md, e.g. "
        "'low=512,high=8192' ('none' as a budget: unbounded).",
    )
    # main.py's flags, built by the same code; requests set the sampling, and no history is kept.
    flags.add_arguments(parser, history=False)
    flags.add_prompt_store_arguments(parser)
    return parser


def validate(args):
    if not 0 <= args.port < 65536:
        raise CliError("--port must be in [0, 65536)")
    if (
        args.max_tokens < 1
        or args.max_queue < 0
        or args.max_batch < 1
        or args.prompt_cache_bytes < 0
        or args.stored_responses < 0
    ):
        raise CliError(
            "--max-tokens and --max-batch must be >= 1, --max-queue, --prompt-cache-bytes and "
            "--stored-responses >= 0"
        )
    if args.api_key is not None and not args.api_key.strip():
        raise CliError("--api-key must not be empty")
    flags.check(args)
    if args.quantized_kv_start:
        raise CliError(
            "--quantized-kv-start: the server quantizes from the first token (0); a batch's rows "
            "would reach any other start at different steps, and decode unlike they do alone"
        )
    from server.reasoning import parse_effort_budgets

    try:
        args.effort_table = parse_effort_budgets(args.effort_budgets)
    except ValueError as error:
        raise CliError(f"--effort-budgets {error}") from None


def build_engine(args, session=None):
    """Load the model and draft sources; returns (engine, model id, context length). ``session``
    (``distributed.start``) shards the target over the launched ranks, which then run in lockstep
    (server/ranks.py)."""
    from cli import sources
    from decoder.cache import CacheKindError, make_cache
    from decoder.text import output_size
    from loading.load import context_length, load_model
    from loading.store import cache_dir
    from server.engine import Engine
    from server.ranks import Lockstep
    from t5 import is_encoder_decoder

    model, tokenizer, path = load_model(args.model, lazy=session is not None)
    if is_encoder_decoder(model):
        raise CliError("the server serves decoder-only models; T5 is not supported")
    if session is not None:
        model = session.shard(model, args.shard)
    vocab_size = output_size(model, tokenizer)
    max_batch, keep_caches = args.max_batch, True
    try:
        make_cache(model, rows=2)  # CacheKindError: a layer kind the batch cannot hold
    except CacheKindError as error:
        # one at a time needs it to be rolled back, at least (CacheKindError: exit 2)
        make_cache(model)
        sys.stderr.write(
            f"note: {error}, so requests are decoded one at a time, without a prompt cache\n"
        )
        max_batch, keep_caches = 1, False
    model, make, drafters = sources.build_sources(args, model, tokenizer, session=session)
    store = flags.open_prompt_store(args, model, session) if keep_caches else None
    if args.prompt_cache_dir is not None and store is None:
        sys.stderr.write("note: so the prompt cache on disk is off too\n")
    engine = Engine(
        model,
        tokenizer,
        vocab_size,
        make,
        max_batch=max_batch,
        max_queue=args.max_queue,
        cache_dir=cache_dir() / "regex-index",
        prompt_cache_bytes=args.prompt_cache_bytes,
        keep_caches=keep_caches,
        drafters=drafters,
        tree_nodes=args.tree_nodes,
        # every rank must fit the same cost, or their drafts differ
        pass_cost=None if session is None else session.pass_cost(),
        ranks=None if session is None else Lockstep(session),
        prompt_store=store,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
    )
    model_id = "SmolLM2-135M-Instruct" if args.model is None else args.model.rstrip("/")
    return engine, model_id, context_length(path)


def listen(host: str, port: int) -> socket.socket:
    """Bind before the model loads, so a taken port fails at once, in one line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as error:
        raise CliError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


def main():
    args = build_parser().parse_args()
    fast_blas.load()  # before anything imports mlx.core (Linux: MLX's own BLAS is far slower)
    import uvicorn

    import distributed
    from decoder.cache import CacheKindError
    from draft_model import VocabularyMismatch
    from loading.load import ModelError
    from mtp.model import NoMTPWeights
    from server.app import build_app
    from server.failures import configure_logging
    from server.harmony import chat_tool_syntax
    from server.ranks import ANSWER_GRACE_S

    try:
        validate(args)
        # Only rank 0 listens; it binds before anything loads, so a taken port fails at once.
        sock = listen(args.host, args.port) if not distributed.launched_rank() else None
        session = distributed.start(args.dist_timeout, fast_blas.set_num_threads, ANSWER_GRACE_S)
        with distributed.reporting_faults():
            engine, model_id, limit = build_engine(args, session)
            if session is not None and session.rank != 0:
                return engine.follow()  # until rank 0 stops, or a peer is lost (one line, exit 1)
    # a cache drafts cannot roll back in, or no MTP layers
    except (CacheKindError, NoMTPWeights) as error:
        sys.stderr.write(f"error: not supported: {error}\n")
        sys.exit(2)
    except (CliError, ModelError, VocabularyMismatch, distributed.DistributedError) as error:
        sys.stderr.write(f"error: {error}\n")
        sys.exit(1)
    app = build_app(
        engine,
        model_id,
        limit,
        args.api_key,
        args.max_tokens,
        args.stored_responses,
        args.effort_table,
    )
    if chat_tool_syntax(engine.tokenizer) is None:
        sys.stderr.write(
            "note: the chat template writes no tool calls this server knows, so tool_choice auto "
            "gets text answers (forced calls are JSON; see docs/server.md)\n"
        )
    configure_logging()  # failed requests, one line each (server/failures.py)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    # Connections wait in the socket's backlog until uvicorn accepts them; tests read this line for
    # --port 0.
    ranks = "" if session is None else f" ({session.size} ranks, {session.mode} sharding)"
    print(f"serving {model_id}{ranks} on http://{args.host}:{sock.getsockname()[1]}/v1", flush=True)
    try:
        asyncio.run(server.serve(sockets=[sock]))
    except KeyboardInterrupt:
        pass
    engine.close()  # sharded: the other ranks stop too
    engine.worker.join(timeout=5)
    engine.close_stores()  # the queued blocks on disk before exiting
    exit_now(0)


def exit_now(status: int):
    """End the process without finalizing the interpreter. MLX frees a thread's compile cache
    when the thread exits, which calls into Python: a worker still exiting while the interpreter
    finalizes aborts the process (std::terminate). Every answer is sent by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
