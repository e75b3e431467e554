"""Grammar-constrained decoding (llguidance) side by side with the built-in regex engine and
XGrammar.

    python -m benchmarks.grammar --part coverage --maskbench /tmp/maskbench   # 1, 2 (the long part)
    python -m benchmarks.grammar --part speed                                 # 3, 4

1. JSON Schema coverage on the development set: compile success, compile time, MaskBench's instance
   tests (0 invalid instances may be accepted), random outputs checked with jsonschema.
2. Mask cost per position on the 49k vocabulary, draft positions included, against one target step.
3. Speed-ups of forced tokens, prompt lookup and the draft head under a grammar, on key-heavy JSON.
4. llama.cpp's grammars (tests/data/gbnf) with the embedded model, outputs checked with `lark`.

Development data: MaskBench (github.com/guidance-ai/jsonschemabench, maskbench/data), only the
splits in DEV_SPLITS; the others are held out for an independent check and are skipped even if
present. Copy them with:
    git --git-dir=<jsonschemabench>/.git ls-tree -r --name-only HEAD maskbench/data |
      while read f; do
        git --git-dir=<jsonschemabench>/.git show HEAD:"$f" > /tmp/maskbench/$(basename "$f")
      done
"""

import argparse
import datetime
import importlib.metadata
import json
import platform
import random
import re
import resource
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from benchmarks.grammar_engines import (
    WALKS,
    LLGuidance,
    XGrammar,
    compact,
    load_dev_set,
    random_outputs,
)
from benchmarks.harness import (
    Method,
    Totals,
    chat_tokens,
    decode_step_ms,
    markdown_table,
    side_by_side,
    time_loop,
)
from benchmarks.json_schema import load_schemas, validator_for
from constrained import compile_regex, schema_to_regex
from constrained.grammar import (
    GrammarConstraint,
    GrammarForcedSource,
    compile_json_schema,
    ll_tokenizer_of,
)
from decoder.text import eos_ids_of
from loading.load import default_dtype, describe_backend, load_model

RESULTS = Path(__file__).parent / "results"
GBNF = Path(__file__).parent.parent / "tests" / "data" / "gbnf"
MEMORY_LIMIT = 12 << 30


def coverage(cases, engines, tokenizer, rng, regex_rng) -> tuple:
    """Per engine: served, compile ms, instance tests, random outputs; and llguidance's compiled
    constraints."""
    eos = eos_ids_of(tokenizer)
    closers = np.array(
        [tokenizer.encode(c, add_special_tokens=False)[0] for c in ['"', "}", "]", ",", "0", "1"]]
    )
    counts = ("served", "valid", "valid_ok", "invalid", "invalid_ok", "outputs", "bad_outputs")
    rows, compiled = {}, []
    for engine in ["regex"] + [e.name for e in engines]:
        rows[engine] = dict(dict.fromkeys(counts, 0), ms=[], failed_walks=0, by_split={})
    for split, name, schema, tests in cases:
        validator = validator_for(schema)
        for engine in [None] + engines:
            key = "regex" if engine is None else engine.name
            handle = serve(engine, schema, rows[key], split)
            if handle is None:
                continue
            if key == "llguidance":
                compiled.append((handle, tests, name))
            check_instances(engine, handle, tests, rows[key])
            if engine is None:
                texts = [
                    t for t in (handle.sample(regex_rng) for _ in range(WALKS)) if t is not None
                ]
            else:
                texts, failed = random_outputs(engine, handle, eos, closers, rng)
                rows[key]["failed_walks"] += failed
            for text in texts:
                rows[key]["outputs"] += 1
                try:
                    rows[key]["bad_outputs"] += not validator.is_valid(json.loads(text))
                except ValueError:
                    rows[key]["bad_outputs"] += 1
    return coverage_tables(rows, len(cases)), compiled


def serve(engine, schema, row: dict, split: str):
    """``schema`` compiled by ``engine`` (None: the built-in regex compiler), timed and counted into
    ``row``; None if it refused."""
    tic = time.perf_counter()
    try:
        handle = (
            compile_regex(schema_to_regex(schema)) if engine is None else engine.compile(schema)
        )
    except Exception:  # noqa: BLE001 - a refusal (RegexError, GrammarError, xgrammar's) or a crash: not served
        handle = None
    row["ms"].append((time.perf_counter() - tic) * 1e3)
    served = row["by_split"].setdefault(split, [0, 0])
    served[1] += 1
    if handle is not None:
        row["served"] += 1
        served[0] += 1
    return handle


def check_instances(engine, handle, tests: list, row: dict):
    """Count into ``row`` the valid and invalid instances that ``handle`` accepts."""
    for test in tests:
        text = compact(test["data"])
        ok = handle.matches(text.encode()) if engine is None else engine.accepts(handle, text)
        row["valid" if test["valid"] else "invalid"] += 1
        row["valid_ok" if test["valid"] else "invalid_ok"] += bool(ok)


def coverage_tables(rows: dict, count: int) -> str:
    """The per-engine table, then the share served per split."""
    lines = [
        "| engine | served | compile ms p50 / p90 / max | valid instances "
        "accepted | invalid accepted | random outputs invalid | walks the engine gave up |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key, row in rows.items():
        ms = sorted(row["ms"])
        lines.append(
            f"| {key} | {row['served']}/{count} ({row['served'] / count:.0%}) | "
            f"{statistics.median(ms):.1f} / {ms[int(0.9 * len(ms))]:.1f} / {ms[-1]:.0f} | "
            f"{row['valid_ok']}/{row['valid']} | {row['invalid_ok']}/{row['invalid']} | "
            f"{row['bad_outputs']}/{row['outputs']} | {row['failed_walks']} |"
        )
    splits = sorted(rows["regex"]["by_split"])
    lines += [
        "",
        "| split | schemas | " + " | ".join(rows) + " |",
        "|---|---:|" + "---:|" * len(rows),
    ]
    for split in splits:
        total = rows["regex"]["by_split"][split][1]
        cells = " | ".join(f"{row['by_split'][split][0] / total:.0%}" for row in rows.values())
        lines.append(f"| {split} | {total} | {cells} |")
    return "\n".join(lines)


def mask_cost(compiled, tokenizer, step_ms, draft=4) -> str:
    """Per-position mask time along MaskBench's valid instances: one position per call, and draft
    calls of `draft` + 1 positions (per position), against one target step measured in the same run
    (other jobs on the machine slow masks and steps alike)."""
    single, per_draft_position, slowest = [], [], (0.0, "")
    ll = ll_tokenizer_of(tokenizer)
    for constraint, tests, name in compiled:
        # gave up in a random walk (counted in the coverage table)
        if constraint.matcher.is_error():
            continue
        for test in tests:
            if not test["valid"]:
                continue
            constraint.reset()
            tokens = ll.tokenize_str(compact(test["data"]))
            if constraint.matcher.validate_tokens(tokens) != len(tokens):
                continue
            for position in range(len(tokens)):
                tic = time.perf_counter()
                constraint.masks(constraint.walk([]))
                single.append(time.perf_counter() - tic)
                slowest = max(slowest, (single[-1], name))
                states = constraint.walk(tokens[position : position + draft])
                tic = time.perf_counter()
                constraint.masks(states)
                per_draft_position.append((time.perf_counter() - tic) / len(states))
                constraint.advance(tokens[position : position + 1])

    def describe(times):
        ms = np.array(times) * 1e3
        p50, p99, top = np.percentile(ms, 50), np.percentile(ms, 99), ms.max()
        return (
            f"p50 {p50:.3f} ms, p99 {p99:.3f} ms, max {top:.2f} ms ({100 * p50 / step_ms:.2f}% / "
            f"{100 * p99 / step_ms:.2f}% / {100 * top / step_ms:.1f}% of a "
            f"{step_ms:.0f} ms step; {len(ms)} positions)"
        )

    return (
        "- llguidance, one position per call (mask as a (1, 49152) mx bool array): "
        f"{describe(single)}\n- llguidance, drafts of {draft} (+1) positions, per position: "
        f"{describe(per_draft_position)}\n- the slowest single position: {slowest[1]} "
        f"({1e3 * slowest[0]:.1f} ms; llguidance builds lexer states lazily, so a schema's first "
        f"visit to a state costs more)\n- one target step measured in this run: {step_ms:.1f} ms "
        "(median of 30)"
    )


def xgrammar_mask_cost(engine, cases, tokenizer) -> str:
    times = []
    for split, name, schema, tests in cases:
        try:
            matcher = engine.compile(schema)
        except Exception:  # noqa: BLE001 - refused schemas are counted in the coverage table
            continue
        for test in tests:
            if not test["valid"]:
                continue
            matcher.reset()
            for token in tokenizer.encode(compact(test["data"]), add_special_tokens=False):
                tic = time.perf_counter()
                engine.allowed(matcher)
                times.append(time.perf_counter() - tic)
                if not matcher.accept_token(token):
                    break
    ms = np.array(times) * 1e3
    return (
        "- xgrammar, one position per call (bitmask -> bool numpy): p50 "
        f"{np.percentile(ms, 50):.3f} ms, p99 {np.percentile(ms, 99):.3f} ms, max {ms.max():.2f} "
        f"ms; {len(ms)} positions"
    )


def speed(model, tokenizer, args) -> str:
    """Key-heavy JSON (benchmarks/json_schemas/suite, llguidance engine), greedy: drafts vs none."""
    from prompt_lookup import PromptLookupSource

    vocab_size = model.args.vocab_size
    schemas = {
        name: schema
        for name, schema in load_schemas("suite").items()
        if not args.schemas or name in args.schemas.split(",")
    }
    prompts, grammars = {}, {}
    for name, schema in schemas.items():
        prompts[name] = [(name, chat_tokens(tokenizer, schema.pop("_prompt")))]
        grammars[name] = compile_json_schema(schema)
    by_prompt = {tuple(items[0][1]): name for name, items in prompts.items()}

    def grammar(forced=False, lookup=False):
        def make(prompt):
            constraint = GrammarConstraint.from_llguidance(
                grammars[by_prompt[tuple(prompt)]], tokenizer, vocab_size
            )
            sources = [GrammarForcedSource(constraint)] if forced else []
            sources += [PromptLookupSource()] if lookup else []
            return dict(constraint=constraint, draft_sources=sources)

        return make

    def with_head(prompt, max_tokens):
        from draft_head.source import HeadDrafter

        tap, drafter = HeadDrafter.create(model, None)
        head = drafter.source()
        kwargs = grammar(forced=True)(prompt)
        kwargs["draft_sources"].append(head)
        return time_loop(tap, prompt, max_tokens, eos_ids_of(tokenizer), **kwargs)

    methods = [
        Method("grammar", grammar()),
        Method("grammar + forced", grammar(forced=True)),
        Method("grammar + lookup", grammar(lookup=True)),
        Method("grammar + forced + lookup", grammar(forced=True, lookup=True)),
        Method("grammar + forced + draft head", run=with_head),
    ]
    results = side_by_side(model, tokenizer, prompts, methods, args.max_tokens)
    total = {m.name: sum((by[m.name].runs for by in results.values()), []) for m in methods}
    results["all schemas"] = {name: Totals(runs) for name, runs in total.items()}
    return markdown_table(results, "grammar").replace("vs plain", "vs grammar")


def gbnf_corpus(model, tokenizer, max_tokens) -> str:
    """Each llama.cpp grammar with the embedded model (greedy, forced drafts); outputs checked with
    lark."""
    from llguidance.gbnf_to_lark import gbnf_to_lark

    from decoder import generate
    from decoder.row import DecodingStats
    from tests.lark_oracle import lark_parser, parses

    prompts = {
        "arithmetic": "Write an equation.",
        "c": "Write a C function that adds two ints.",
        "chess": "Play a chess opening.",
        "english": "Say hello.",
        "japanese": "Say hello in Japanese.",
        "json": "Describe a cat as JSON.",
        "json_arr": "List three colours as a JSON array.",
        "list": "List three fruits.",
    }
    lines = [
        "| grammar | finished | lark parses | tokens | passes/token | output (start) |",
        "|---|---|---|---:|---:|---|",
    ]
    for path in sorted(GBNF.glob("*.gbnf")):
        text = path.read_text()
        constraint = GrammarConstraint.from_grammar(text, tokenizer, model.args.vocab_size)
        result = generate(
            model,
            tokenizer,
            chat_tokens(tokenizer, prompts.get(path.stem, "Write something.")),
            constraint=constraint,
            draft_sources=[GrammarForcedSource(constraint)],
            max_tokens=max_tokens,
            stats=DecodingStats(),
        )
        finished = result.finish_reason == "stop"
        parsed = parses(lark_parser(gbnf_to_lark(text)), result.text) if finished else "-"
        passes = result.stats.target_forward_passes / max(result.generation_tokens, 1)
        lines.append(
            f"| {path.name} | {finished} | {parsed} | {result.generation_tokens} | {passes:.3f} | "
            f"`{json.dumps(result.text[:40])[1:-1]}` |"
        )
    return "\n".join(lines)


COVERAGE_NOTE = """Development set: MaskBench's Github_trivial, Github_ultra, Handwritten,
Synthesized, MCPspec, BFCL_* and JME_* splits only (a fixed random sample per split). Each engine
compiles each schema for compact JSON; "valid instances accepted" and "invalid accepted" run
MaskBench's instance tests (compact serialisation; invalid accepted must be 0); "random outputs
invalid" are texts of random token walks under the engine's masks that ended with EOS, checked with
jsonschema (formats on). The machine was shared with other jobs (2 cores).

"""


def write_part(part: str, text: str):
    """Results go to results/grammar.md, one part (coverage, speed) at a time: the other part is
    kept."""
    path = RESULTS / "grammar.md"
    old = path.read_text() if path.exists() else ""
    parts = dict(re.findall(r"<!-- part: (\w+) -->\n(.*?)(?=<!-- part: |\Z)", old, re.S))
    parts[part] = text + "\n\n"
    path.write_text(
        "".join(
            f"<!-- part: {name} -->\n{parts[name]}"
            for name in ("coverage", "speed")
            if name in parts
        )
    )


def main():
    parser = argparse.ArgumentParser(
        description="Grammar-constrained decoding benchmark (llguidance)."
    )
    parser.add_argument(
        "--maskbench", type=Path, help="A folder of MaskBench's data files (for --part coverage)."
    )
    parser.add_argument(
        "--part",
        choices=["coverage", "speed"],
        required=True,
        help="coverage: JSON Schema engines and mask cost; speed: drafts under a grammar, GBNF "
        "corpus.",
    )
    parser.add_argument(
        "--per-split", type=int, default=15, help="Schemas sampled per split (default: 15)."
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--schemas",
        default=None,
        help="Comma-separated suite schemas for --part speed (default: all).",
    )
    args = parser.parse_args()
    import llguidance

    model, tokenizer, _ = load_model()
    vocab_size = model.args.vocab_size
    header = (
        f"{datetime.date.today()} · {platform.node() or 'this machine'} · {describe_backend()} · "
        f"SmolLM2-135M-Instruct {default_dtype()} · greedy · llguidance {llguidance.__version__} · "
        f"mlx {mx.__version__}"
    )
    print(header, flush=True)
    command = f"`python -m benchmarks.grammar {' '.join(sys.argv[1:])}`"
    if args.part == "speed":
        sections = [
            header + f" · max {args.max_tokens} new tokens · {command}",
            f"## Drafts under a grammar: key-heavy JSON (benchmarks/json_schemas/suite)\n\n"
            f"{speed(model, tokenizer, args)}",
            f"## llama.cpp grammars (tests/data/gbnf) with the embedded model, forced drafts\n\n"
            f"{gbnf_corpus(model, tokenizer, args.max_tokens)}",
        ]
        print("\n\n".join(sections[1:]), flush=True)
        write_part("speed", "\n\n".join(sections))
        return
    step_ms = decode_step_ms(model)  # before the cap below, under which OpenBLAS slows down
    # The regex compiler can take all the memory on some Github_ultra schemas (until the kernel
    # kills it); cap the address space so that shows as a MemoryError, counted as not served.
    resource.setrlimit(
        resource.RLIMIT_AS, (MEMORY_LIMIT, resource.getrlimit(resource.RLIMIT_AS)[1])
    )
    cases = load_dev_set(args.maskbench, args.per_split)
    engines = [LLGuidance(tokenizer, vocab_size)]
    try:
        engines.append(XGrammar(tokenizer, vocab_size))
        header += f" · xgrammar {importlib.metadata.version('xgrammar')}"
    except ImportError:
        print("xgrammar is not installed: its columns are left out (pip install xgrammar)")
    table, compiled = coverage(
        cases, engines, tokenizer, np.random.default_rng(0), random.Random(0)
    )
    sections = [
        COVERAGE_NOTE + header + f" · {command}",
        f"## JSON Schema coverage: {len(cases)} MaskBench schemas (<= {args.per_split} per "
        f"development split), compact JSON\n\n{table}",
    ]
    print(sections[-1], flush=True)
    masks = mask_cost(compiled, tokenizer, step_ms)
    if len(engines) > 1:
        masks += "\n" + xgrammar_mask_cost(engines[1], cases, tokenizer)
    sections.append(f"## Mask cost per position (49,152-token vocabulary)\n\n{masks}")
    print(sections[-1], flush=True)
    write_part("coverage", "\n\n".join(sections))


if __name__ == "__main__":
    main()
