"""Draft trees (issue #51): prompt lookup drafting trees against chains, one row and 8, and the
pass cost curve the ``auto`` policy reads.

    flock /tmp/mlxdec-test.lock python -m benchmarks.draft_trees

Greedy decoding of the embedded model on grounded prompts (code_edit, extractive_qa,
summarize_quotes) and open ones (open_ended), in interleaved rounds. Methods: plain; lookup
chains as they are by default (``--tree-nodes 0``); lookup trees with ``auto``; and a fixed
budget of N nodes per step as one chain (``num_draft=N``, not adaptive) or one tree of N nodes.
Every output must equal plain decoding. Then 8 rows at once in ``BatchGenerator``, chains
against trees. Then the cost of a pass by width, as a chain and as a tree (its mask and
per-node rope). Writes benchmarks/results/draft_trees.md.
"""

import argparse
import time
from pathlib import Path

import mlx.core as mx

from batch import BatchGenerator
from benchmarks.harness import first_prompts, heldout_prompts, load_prompts, median_ms, time_loop
from decoder.cache import make_cache
from decoder.text import eos_ids_of
from decoder.tree import layout
from decoder.tree_pass import enable_trees
from prompt_lookup import PromptLookupSource

RESULTS = Path(__file__).parent / "results" / "draft_trees.md"
GROUNDED = ["code_edit", "extractive_qa", "summarize_quotes"]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2, help="prompts per task class")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget", type=int, default=8, help="N, the fixed node budget")
    parser.add_argument("--chat-prompts", type=int, default=6, help="held-out chat prompts")
    return parser.parse_args()


def methods(budget: int) -> dict:
    """name -> (the source's settings, tree_nodes)."""
    return {
        "plain": (None, 0),
        "lookup chains": ({}, 0),
        "lookup trees, auto": ({}, "auto"),
        f"chain of {budget}": ({"num_draft": budget, "adaptive": False}, 0),
        f"tree of {budget}": ({"num_draft": budget, "adaptive": False}, budget),
    }


def one_row(model, tokenizer, args) -> list:
    """Rows of (prompts, method, tokens, passes per token, tok/s, peak GB)."""
    eos, table = eos_ids_of(tokenizer), {}
    prompts = first_prompts(load_prompts(tokenizer), args.prompts)
    for round_ in range(args.rounds):
        for task, items in prompts.items():
            kind = "grounded" if task in GROUNDED else "open"
            for _, prompt in items:
                plain = None
                for name, (settings, tree_nodes) in methods(args.budget).items():
                    sources = [] if settings is None else [PromptLookupSource(**settings)]
                    run = time_loop(
                        model,
                        prompt,
                        args.max_tokens,
                        eos,
                        draft_sources=sources,
                        tree_nodes=tree_nodes,
                    )
                    plain = run.tokens if plain is None else plain
                    if run.tokens != plain:
                        raise SystemExit(f"{name} differs from plain decoding on a {task} prompt")
                    total = table.setdefault((kind, name), [0, 0, 0.0, 0.0])
                    total[0] += len(run.tokens)
                    total[1] += run.forward_passes
                    total[2] += run.decode_time
                    total[3] = max(total[3], run.peak_memory_gb)
        print(f"round {round_ + 1} done", flush=True)
    return [
        (kind, name, tokens, passes / tokens, tokens / seconds, peak)
        for (kind, name), (tokens, passes, seconds, peak) in table.items()
    ]


def head_chat(model, tokenizer, args) -> list:
    """Rows of (method, tokens, passes per token, tok/s, peak GB) on held-out chat: the shipped
    draft head alone and after history lookup (its seed store), as chains and as trees."""
    from draft_head.head import SHIPPED_HEAD
    from draft_head.source import HeadDrafter
    from prompt_lookup.history import HistoryLookupSource, load_history

    eos, seed = eos_ids_of(tokenizer), load_history(SHIPPED_HEAD / "history.npz")
    tap, drafter = HeadDrafter.create(model)
    enable_trees(tap)
    head = drafter.source()
    runs = {
        "draft head": lambda: [head],
        "history (seed) + head": lambda: [HistoryLookupSource(seed), head],
    }
    table = {}
    for _ in range(args.rounds):
        for _, prompt in heldout_prompts(tokenizer)[: args.chat_prompts]:
            want = None
            for name, sources in runs.items():
                for shape, tree_nodes in (("chains", 0), ("trees, auto", "auto")):
                    run = time_loop(
                        tap,
                        prompt,
                        args.max_tokens,
                        eos,
                        draft_sources=sources(),
                        tree_nodes=tree_nodes,
                    )
                    want = run.tokens if want is None else want
                    if run.tokens != want:
                        raise SystemExit(f"{name} ({shape}) differs on a chat prompt")
                    total = table.setdefault(f"{name}, {shape}", [0, 0, 0.0, 0.0])
                    total[0] += len(run.tokens)
                    total[1] += run.forward_passes
                    total[2] += run.decode_time
                    total[3] = max(total[3], run.peak_memory_gb)
    return [(n, t, p / t, t / s, g) for n, (t, p, s, g) in table.items()]


def mtp_tiny(args) -> list:
    """Rows of (method, tokens, passes per token, tok/s) for the MTP layer of a tiny random
    DeepSeek-V3 checkpoint whose MTP layer is right often, not always (tests/mtp_fixtures.py)."""
    import tempfile

    from loading.target import load_mlx_lm
    from mtp.source import MTPDrafter
    from tests.helpers import tiny_byte_tokenizer
    from tests.mtp_fixtures import write_checkpoint

    path = Path(tempfile.mkdtemp())
    write_checkpoint(
        path, "deepseek_v3", seed=1, exact=True, noise=0.08, tokenizer=tiny_byte_tokenizer()
    )
    target = load_mlx_lm(path)[0]
    table = {}
    for _ in range(args.rounds):
        for prompt in ([5, 6, 7, 8], [1, 2], list(range(2, 30, 3))):
            for shape, tree_nodes in (("chains", 0), ("trees, auto", "auto"), ("trees of 8", 8)):
                tap, drafter = MTPDrafter.create(target, path)
                enable_trees(tap)
                run = time_loop(
                    tap, prompt, 120, (), draft_sources=[drafter.source()], tree_nodes=tree_nodes
                )
                total = table.setdefault(shape, [0, 0, 0.0])
                total[0] += len(run.tokens)
                total[1] += run.forward_passes
                total[2] += run.decode_time
    return [(n, t, p / t, t / s) for n, (t, p, s) in table.items()]


def constrained(model, tokenizer, args) -> list:
    """Rows of (prompts, method, tokens, passes per token, tok/s) for constrained rows: forced text
    and lookup, chains against trees (each node masked after its own path, forced text below its
    leaves). The JSON suite's schemas with their own requests (open), and the grounded prompts
    answered as ``{"answer": "..."}`` (lookup copies from the document inside the string)."""
    from benchmarks.harness import chat_tokens
    from benchmarks.json_schema import schema_requests
    from constrained import ForcedTextSource, RegexConstraint

    eos, vocab = eos_ids_of(tokenizer), model.args.vocab_size
    answer = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 400}}}
    answer["required"] = ["answer"]
    grounded = load_prompts(tokenizer, GROUNDED)
    cases = [
        ("open", chat_tokens(tokenizer, text), schema) for text, schema in schema_requests("suite")
    ]
    cases += [
        ("grounded", tokens, answer)
        for items in grounded.values()
        for _, tokens in items[: args.prompts]
    ]
    table = {}
    for _ in range(args.rounds):
        for kind, prompt, schema in cases:
            want = None
            for name, tree_nodes in (
                ("forced + lookup chains", 0),
                ("forced + lookup trees, auto", "auto"),
            ):
                constraint = RegexConstraint.from_json_schema(schema, tokenizer, vocab)
                sources = [ForcedTextSource(constraint), PromptLookupSource()]
                run = time_loop(
                    model,
                    prompt,
                    args.max_tokens,
                    eos,
                    constraint=constraint,
                    draft_sources=sources,
                    tree_nodes=tree_nodes,
                )
                want = run.tokens if want is None else want
                if run.tokens != want:
                    raise SystemExit(f"{name} differs from chains on a constrained {kind} prompt")
                total = table.setdefault((kind, name), [0, 0, 0.0])
                total[0] += len(run.tokens)
                total[1] += run.forward_passes
                total[2] += run.decode_time
    return [(k, n, t, p / t, t / s) for (k, n), (t, p, s) in table.items()]


def batch_of_8(model, tokenizer, args) -> list:
    """Rows of (method, tokens, passes, tok/s in all) for 8 grounded prompts at once: adaptive
    chains and trees, then a fixed budget of N nodes per row as a chain and as a tree."""
    eos = eos_ids_of(tokenizer)
    prompts = [
        tokens for items in load_prompts(tokenizer, GROUNDED).values() for _, tokens in items
    ][:8]
    fixed = {"num_draft": args.budget, "adaptive": False}
    batch_methods = {
        "lookup chains": ({}, 0),
        "lookup trees, auto": ({}, "auto"),
        f"chain of {args.budget}": (fixed, 0),
        f"tree of {args.budget}": (fixed, args.budget),
    }
    totals, want = {}, None
    for _ in range(args.rounds):
        for name, (settings, tree_nodes) in batch_methods.items():
            generator = BatchGenerator(model, eos_token_ids=eos, tree_nodes=tree_nodes)
            uids = generator.insert(
                prompts,
                draft_sources=[[PromptLookupSource(**settings)] for _ in prompts],
                max_tokens=args.max_tokens,
            )
            tokens, tic = {uid: [] for uid in uids}, time.perf_counter()
            while responses := generator.next():
                for response in responses:
                    tokens[response.uid] += response.tokens
            seconds = time.perf_counter() - tic
            outputs = [tokens[uid] for uid in uids]
            want = outputs if want is None else want
            if outputs != want:
                raise SystemExit(f"batched {name} differs from batched chains")
            total = totals.setdefault(name, [0, 0, 0.0])
            total[0] += sum(map(len, outputs))
            total[1] += generator.stats.passes
            total[2] += seconds
    return [(name, t, p, t / s) for name, (t, p, s) in totals.items()]


def pass_curve(model) -> list:
    """Rows of (width, chain pass ms, tree pass ms) over 256 cached tokens; the tree is a root
    with ``width - 1`` children, the widest mask it can have."""
    rows = []
    for width in (1, 2, 4, 8, 16, 32):
        timings = []
        for tree in (False, True):
            cache = make_cache(model)
            model(mx.zeros((1, 256), mx.int32), cache=cache.layers)
            inputs = mx.ones((1, width), mx.int32)
            parents = [-1] * (width - 1)
            layouts = [layout(1, parents, width)] if tree else None

            def one_pass(cache=cache, inputs=inputs, layouts=layouts):
                cache.prepare([width], width, layouts)
                mx.eval(model(inputs, cache=cache.layers))
                cache.finalize()
                cache.rewind([width])

            timings.append(median_ms(one_pass, 9)[0])
        rows.append((width, *timings))
    return rows


def other_sections(args, chat, mtp, masked, batch, curve) -> list:
    """The report's lines after the one-row table."""
    return [
        "## The draft head on held-out chat",
        "",
        f"The shipped head, alone and after history lookup (its seed store), "
        f"{args.chat_prompts} prompts of benchmarks/heldout/chat.txt; trees grow as EAGLE-2's "
        "from a frontier of 4 nodes per depth (docs/draft_trees.md). Every output equals the "
        "first method's.",
        "",
        "| method | tokens | passes/token | tok/s | peak GB |",
        "|---|---:|---:|---:|---:|",
        *(f"| {n} | {t} | {p:.3f} | {r:.1f} | {g:.2f} |" for n, t, p, r, g in chat),
        "",
        "## MTP",
        "",
        "No model with MTP layers runs here: a tiny random DeepSeek-V3 checkpoint whose MTP "
        "layer is right often, not always (tests/mtp_fixtures.py, noise 0.08), three prompts of "
        "120 tokens. Its tok/s says little (the tiny MTP layer costs about what the tiny target "
        "does); passes per token is the figure.",
        "",
        "| method | tokens | passes/token | tok/s |",
        "|---|---:|---:|---:|",
        *(f"| {n} | {t} | {p:.3f} | {r:.1f} |" for n, t, p, r in mtp),
        "",
        "## Constrained rows",
        "",
        "Forced text and prompt lookup under a JSON Schema (the regex compiler): the JSON "
        "suite's schemas with their own requests (open), and the grounded prompts answered as "
        '`{"answer": "..."}`. Trees mask each node after its own path and draft forced text '
        "below their leaves. Every output equals the chains'.",
        "",
        "| prompts | method | tokens | passes/token | tok/s |",
        "|---|---|---:|---:|---:|",
        *(f"| {k} | {n} | {t} | {p:.3f} | {r:.1f} |" for k, n, t, p, r in masked),
        "",
        "## 8 rows at once",
        "",
        "8 grounded prompts in one `BatchGenerator`, each row with its own lookup; a fixed budget "
        "of N nodes per row as a chain (`num_draft` N, not adaptive) and as a tree of N.",
        "",
        "| method | tokens | passes | tok/s in all |",
        "|---|---:|---:|---:|",
        *(f"| {n} | {t} | {p} | {r:.1f} |" for n, t, p, r in batch),
        "",
        "## The pass cost curve",
        "",
        "One pass over 256 cached tokens, median of 9; a tree pass is a root with width - 1 "
        "children (its mask is an array, its rope runs per node).",
        "",
        "| width | chain pass ms | tree pass ms |",
        "|---:|---:|---:|",
        *(f"| {w} | {c:.1f} | {t:.1f} |" for w, c, t in curve),
        "",
    ]


def main():
    args = parse_args()
    from loading.load import load_model

    model, tokenizer, _ = load_model(None)
    assert enable_trees(model)
    curve = pass_curve(model)
    rows = one_row(model, tokenizer, args)
    batch = batch_of_8(model, tokenizer, args)
    chat = head_chat(model, tokenizer, args)
    mtp = mtp_tiny(args)
    masked = constrained(model, tokenizer, args)
    dtype = str(model.model.embed_tokens.weight.dtype).removeprefix("mlx.core.")
    lines = [
        "# Draft trees (issue #51)",
        "",
        "Command: `flock /tmp/mlxdec-test.lock .venv/bin/python -m benchmarks.draft_trees "
        f"--prompts {args.prompts} --max-tokens {args.max_tokens} --rounds {args.rounds} "
        f"--budget {args.budget} --chat-prompts {args.chat_prompts}`",
        "",
        f"Embedded SmolLM2-135M-Instruct ({dtype}), greedy, a 2-core Linux CPU (shared), "
        "decoding time only (prefill apart). Every output equals plain decoding.",
        "",
        "## One row",
        "",
        "Summed over prompts and rounds (methods interleaved per prompt).",
        "",
        "| prompts | method | tokens | passes/token | tok/s | peak GB |",
        "|---|---|---:|---:|---:|---:|",
        *(
            f"| {k} | {n} | {t} | {p:.3f} | {r:.1f} | {g:.2f} |"
            for k, n, t, p, r, g in sorted(rows, key=lambda row: row[0], reverse=True)
        ),
        "",
        *other_sections(args, chat, mtp, masked, batch, curve),
    ]
    text = "\n".join(lines)
    print(text)
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
