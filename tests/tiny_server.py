"""The server on a tiny random model, for tests that need many requests fast (no model to load).

    python -m tests.tiny_server [--prompt-lookup] [--tree-nodes N] [--max-batch N] [--max-queue N]
    [--prompt-cache-bytes N] [--prompt-cache-dir DIR] [--block-tokens N] [--kv-bits N] [--hermes]
        [--thinking optional|opens] [--harmony]

Prints "serving tiny on http://127.0.0.1:PORT/v1" once it listens, as ``python -m server`` does.
The model is ``model()``, so a test builds the same one to compute what the server should answer.
"""

import argparse
import asyncio

from loading import fast_blas

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
# Tool calls as Hermes and Qwen templates write them (mlx-lm reads "<tool_call>" and
# "tool_call.name" as json_tools).
HERMES_TEMPLATE = (
    "{% if tools %}tools: "
    "{{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}{{ '\\n' }}"
    "{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% for call in m.get('tool_calls') or [] %}{% set tool_call = call['function'] %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", '
    '"arguments": {{ tool_call.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}{{ '\\n' }}{% endfor %}assistant:"
)  # HF templates trim a newline after a tag


# Thinking templates: Qwen3's leaves the block to the model ("optional"), Qwen3.5's opens it
# ("opens"); both write an empty closed block when thinking is turned off.
THINK_OFF = "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
THINKING_TEMPLATES = {
    "optional": THINK_OFF + "{% endif %}",
    "opens": THINK_OFF + "{% else %}<think>\n{% endif %}",
}


def tokenizer(hermes: bool = False, thinking: str = None):
    """tests.helpers' byte-level tokenizer with a chat template, wrapped as mlx-lm loads one (its
    apply_chat_template gives token ids); ``hermes``: a template that writes tool calls, and the
    json_tools parser mlx-lm picks for one; ``thinking``: "optional" or "opens", a template of a
    thinking model (THINKING_TEMPLATES), and ``<think>`` ``</think>`` in the vocabulary."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from mlx_lm.tool_parsers import json_tools

    from tests.helpers import tiny_byte_tokenizer

    byte_tokenizer = tiny_byte_tokenizer(thinking=thinking is not None)
    byte_tokenizer.chat_template = HERMES_TEMPLATE if hermes else CHAT_TEMPLATE
    if thinking is not None:
        byte_tokenizer.chat_template += THINKING_TEMPLATES[thinking]
    if not hermes:
        return TokenizerWrapper(byte_tokenizer)
    return TokenizerWrapper(
        byte_tokenizer,
        tool_parser=json_tools.parse_tool_call,
        tool_call_start=json_tools.tool_call_start,
        tool_call_end=json_tools.tool_call_end,
    )


# As GPT-OSS's template writes a call: to a function, in the commentary channel, ended by <|call|>.
HARMONY_CALL = (
    "{% set call = m.tool_calls[0].function %}<|start|>assistant to=functions.{{ call.name }}"
    "<|channel|>commentary json<|message|>{{ call.arguments | tojson }}<|call|>"
)
HARMONY_TEMPLATE = (
    "{% for m in messages %}{% if m.get('tool_calls') %}" + HARMONY_CALL + "{% else %}"
    "<|start|>{{ m['role'] }}{% if m.get('reasoning_content') %}"
    "<|channel|>analysis<|message|>{{ m['reasoning_content'] }}<|end|><|start|>assistant"
    "<|channel|>final{% endif %}<|message|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "<|start|>assistant"
)


def harmony_tokenizer():
    """tests.helpers' byte-level tokenizer with harmony's special tokens and HARMONY_TEMPLATE, as
    GPT-OSS's."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import AddedToken

    from tests.helpers import tiny_byte_tokenizer

    tokenizer = tiny_byte_tokenizer()
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                AddedToken(t, special=True)
                for t in [
                    "<|start|>",
                    "<|channel|>",
                    "<|message|>",
                    "<|end|>",
                    "<|return|>",
                    "<|call|>",
                    "<|constrain|>",
                ]
            ]
        }
    )
    tokenizer.chat_template = HARMONY_TEMPLATE
    return TokenizerWrapper(tokenizer)


def vocab_size(thinking: bool = False) -> int:
    from tests.helpers import tiny_byte_tokenizer

    return len(tiny_byte_tokenizer(thinking=thinking))


def model(thinking: bool = False, hidden_size: int = 32):
    """``hidden_size`` 128: heads 32 wide, which a quantized cache's groups of 32 divide."""
    from tests.helpers import tiny_llama

    return tiny_llama(
        vocab_size=vocab_size(thinking), num_layers=2, hidden_size=hidden_size, seed=3, sharp=3.0
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-lookup", action="store_true")
    parser.add_argument("--tree-nodes", default="0", help="As python -m server's.")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-queue", type=int, default=8)
    parser.add_argument("--prompt-cache-bytes", type=int, default=2**20)
    parser.add_argument("--prompt-cache-dir", default=None, help="As python -m server's.")
    parser.add_argument("--block-tokens", type=int, default=16, help="The prompt store's.")
    parser.add_argument("--kv-bits", type=int, default=None, help="As python -m server's.")
    parser.add_argument(
        "--hermes", action="store_true", help="A chat template that writes Hermes tool calls."
    )
    parser.add_argument(
        "--thinking",
        choices=["optional", "opens"],
        default=None,
        help="A thinking model's template (THINKING_TEMPLATES).",
    )
    parser.add_argument("--effort-budgets", default=None, help="As python -m server's.")
    parser.add_argument(
        "--harmony",
        action="store_true",
        help="GPT-OSS's harmony template (tests/test_thinking.py).",
    )
    args = parser.parse_args()
    fast_blas.load()
    import uvicorn

    from decoder.pass_cost import PassCost
    from prompt_lookup.ngram import PromptLookupSource
    from server.__main__ import exit_now, listen
    from server.app import build_app
    from server.engine import Engine
    from server.failures import configure_logging

    sources = (lambda: [PromptLookupSource()]) if args.prompt_lookup else list
    # Passes timed at zero seconds: rows draft whenever their sources do, however loaded the
    # machine.
    thinking = args.thinking is not None
    model_, tokenizer_, vocab = (
        model(thinking, 32 if args.kv_bits is None else 128),
        tokenizer(args.hermes, args.thinking),
        vocab_size(thinking),
    )
    if args.harmony:
        from tests.helpers import tiny_llama

        tokenizer_ = harmony_tokenizer()
        vocab = len(tokenizer_)
        model_ = tiny_llama(vocab_size=vocab, num_layers=2, hidden_size=32, seed=3, sharp=3.0)
    store = None
    if args.prompt_cache_dir is not None:
        from prompt_store import PromptStore

        store = PromptStore(args.prompt_cache_dir, model_, block_tokens=args.block_tokens)
    engine = Engine(
        model_,
        tokenizer_,
        vocab,
        sources,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        prompt_cache_bytes=args.prompt_cache_bytes,
        pass_cost=PassCost(clock=lambda: 0.0),
        tree_nodes=args.tree_nodes if args.tree_nodes == "auto" else int(args.tree_nodes),
        prompt_store=store,
        kv_bits=args.kv_bits,
        kv_group_size=32,  # the tiny model's heads are 32 wide
    )
    sock = listen("127.0.0.1", 0)
    from server.reasoning import parse_effort_budgets

    app = build_app(
        engine,
        "tiny",
        context_length=4096,
        effort_budgets=parse_effort_budgets(args.effort_budgets or ""),
    )
    configure_logging()  # failed requests, one line each (server/failures.py)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    print(f"serving tiny on http://127.0.0.1:{sock.getsockname()[1]}/v1", flush=True)
    asyncio.run(server.serve(sockets=[sock]))
    engine.close()
    engine.worker.join(timeout=5)
    if store is not None:
        store.close()
    exit_now(0)  # as python -m server ends


if __name__ == "__main__":
    main()
