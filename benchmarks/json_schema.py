"""JSON Schema suite: compile time, DFA states, first token, index memory and speed; coverage of
other schemas.

    python -m benchmarks.json_schema            # pip install outlines-core for its columns
    (optional) python -m benchmarks.json_schema --coverage-only

Schemas: benchmarks/json_schemas/suite/*.json (ours, each with a "_prompt") and
benchmarks/json_schemas/realistic/*.json (function-call and GitHub-config style, not tuned to the
compiler: only the share served vs refused is reported). Tables go to
benchmarks/results/json_schema.md.
"""

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.harness import (
    Method,
    Totals,
    chat_tokens,
    decode_step_ms,
    markdown_table,
    median_ms,
    side_by_side,
)
from constrained import (
    ForcedTextSource,
    RegexConstraint,
    RegexError,
    TokenSplits,
    compile_regex,
    schema_to_regex,
)
from constrained.token_index import TokenIndex, TokenTable, token_byte_strings
from decoder import generate_step
from decoder.row import DecodingStats
from decoder.text import eos_ids_of
from loading.load import default_dtype, describe_backend, load_model

SCHEMAS = Path(__file__).parent / "json_schemas"
RESULTS = Path(__file__).parent / "results"


def load_schemas(folder: str) -> dict:
    return {
        path.stem: json.loads(path.read_text())
        for path in sorted((SCHEMAS / folder).glob("*.json"))
    }


def schema_requests(folder: str) -> list:
    """(request text, schema) for each schema in ``folder`` that carries its ``_prompt``, as the
    batch and server-load benchmarks send them."""
    return [
        (
            schema["_prompt"] + " Answer with the JSON only.",
            {k: v for k, v in schema.items() if k != "_prompt"},
        )
        for schema in load_schemas(folder).values()
    ]


def validator_for(schema):
    """A jsonschema validator for the schema's draft (2020-12 when it names none), formats
    checked."""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


OUTLINES_MEMORY_LIMIT = 4 << 30
OUTLINES_TIMEOUT_S = 120


def outlines_vocabulary(token_bytes, eos):
    """The same token bytes, as outlines-core wants them (None when it is not installed)."""
    try:
        import outlines_core
    except ImportError:
        return None
    by_bytes = {}
    for token_id, data in enumerate(token_bytes):
        if data is not None:
            by_bytes.setdefault(data, []).append(token_id)
    return outlines_core.Vocabulary(min(eos), by_bytes)


def _outlines_child(schema, vocabulary, connection):
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    try:
        regex_ms, regex = median_ms(lambda: build_regex_from_schema(json.dumps(schema)), 1)
        index_ms, index = median_ms(lambda: outlines_core.Index(regex, vocabulary), 1)
        connection.send(f"{regex_ms:.1f} | {index_ms:.0f} | {len(index.get_transitions())}")
    except Exception as error:  # noqa: BLE001 - report what it refuses, as for ours
        connection.send(f"error: {str(error)[:40]} | - | -")


def outlines_columns(schema, vocabulary):
    """outlines-core's schema -> regex ms, Index ms and states, in a child process whose memory is
    watched (its full index of a large schema can take more memory than this machine has); dashes if
    not installed."""
    if vocabulary is None:
        return "- | - | -"
    import multiprocessing

    receiver, sender = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(
        target=_outlines_child, args=(schema, vocabulary, sender)
    )
    child.start()
    tic, peak = time.perf_counter(), 0
    while child.is_alive() and not receiver.poll(0.2):
        peak = max(peak, _rss_bytes(child.pid))
        if peak > OUTLINES_MEMORY_LIMIT or time.perf_counter() - tic > OUTLINES_TIMEOUT_S:
            child.kill()
            child.join()
            reason = (
                f"> {OUTLINES_MEMORY_LIMIT >> 30} GB"
                if peak > OUTLINES_MEMORY_LIMIT
                else f"> {OUTLINES_TIMEOUT_S} s"
            )
            return f"- | stopped: {reason} | -"
    result = receiver.recv() if receiver.poll(1) else "error: no result | - | -"
    child.join()
    return result


def _rss_bytes(pid: int) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def first_token_and_memory(model, tokenizer, dfa, table, eos, prompt, max_tokens):
    """Seconds from a compiled DFA to the first token (index + prefill + step), the prefill alone,
    and the peak index memory (DFA + token table + cached rows) over a whole forced-draft
    generation."""
    stats = DecodingStats()
    tic = time.perf_counter()
    index = TokenIndex.build(dfa, table, eos)
    constraint = RegexConstraint(index, TokenSplits(tokenizer))
    steps = generate_step(
        prompt,
        model,
        constraint=constraint,
        max_tokens=max_tokens,
        eos_token_ids=eos,
        draft_sources=[ForcedTextSource(constraint)],
        stats=stats,
    )
    next(steps)
    first = time.perf_counter() - tic
    peak_rows = index.cached_bytes
    for _ in steps:
        peak_rows = max(peak_rows, index.cached_bytes)  # the LRU bounds it; measured, not assumed
    memory = dfa.transitions.nbytes + table.token_bytes.nbytes + peak_rows
    return first, stats.prompt_time, memory


def suite(model, tokenizer, args):
    vocab_size, eos = model.args.vocab_size, sorted(eos_ids_of(tokenizer))
    token_bytes = token_byte_strings(tokenizer, vocab_size)
    table = TokenTable.build(token_bytes)
    vocabulary = outlines_vocabulary(token_bytes, eos)
    cases = load_schemas("suite")
    lines = [
        "| schema | to regex ms | compile s | DFA states | first token s (prefill s) | index MiB "
        "| outlines regex ms | outlines Index ms | outlines states |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    prompts = {}
    for name, schema in cases.items():
        prompt = chat_tokens(tokenizer, schema.pop("_prompt"))
        prompts[name] = prompt
        regex_ms, regex = median_ms(lambda: schema_to_regex(schema), 3)
        compile_ms, dfa = median_ms(lambda: compile_regex(regex), 1)
        first, prefill, memory = first_token_and_memory(
            model, tokenizer, dfa, table, eos, prompt, args.max_tokens
        )
        lines.append(
            f"| {name} | {regex_ms:.1f} | {compile_ms / 1e3:.2f} | {dfa.num_states} | {first:.2f} "
            f"({prefill:.2f}) | {memory / 2**20:.1f} | {outlines_columns(schema, vocabulary)} |"
        )
        print(lines[-1])

    def constrained(forced):
        def make(prompt):
            schema = cases[next(name for name, p in prompts.items() if p == prompt)]
            constraint = RegexConstraint.from_json_schema(schema, tokenizer, vocab_size)
            return {
                "constraint": constraint,
                "draft_sources": [ForcedTextSource(constraint)] if forced else [],
            }

        return make

    methods = [
        Method("constrained", constrained(False)),
        Method("constrained + forced drafts", constrained(True)),
    ]
    results = side_by_side(
        model,
        tokenizer,
        {name: [(name, prompt)] for name, prompt in prompts.items()},
        methods,
        args.max_tokens,
    )
    runs = [results[name]["constrained"].runs[0] for name in prompts]
    results["all schemas"] = {
        m.name: Totals([run for name in prompts for run in results[name][m.name].runs])
        for m in methods
    }
    valid = validate_outputs(tokenizer, cases, prompts, runs, eos)
    speed = markdown_table(results, "constrained").replace("vs plain", "vs constrained")
    return (
        "\n".join(lines)
        + "\n\n"
        + speed
        + f"\n\n{valid}\n\n"
        + mask_cost(model, table, eos, cases["order"])
    )


def validate_outputs(tokenizer, cases, prompts, runs, eos):
    finished = [
        (name, run.tokens[:-1])
        for name, run in zip(prompts, runs)
        if run.tokens and run.tokens[-1] in eos
    ]
    try:
        valid = sum(
            validator_for(cases[name]).is_valid(json.loads(tokenizer.decode(tokens)))
            for name, tokens in finished
        )
    except ImportError:
        return "outputs: not validated (pip install jsonschema)"
    return (
        f"outputs: {len(finished)}/{len(runs)} finished with EOS, {valid}/{len(finished)} of those "
        "validate (jsonschema, formats on)"
    )


def mask_cost(model, table, eos, schema):
    """Per-step cost of masking: a cached row (steady state) and a cold row build, vs one decoding
    step."""
    index = TokenIndex.build(compile_regex(schema_to_regex(schema)), table, eos)
    logits = mx.random.normal((1, table.vocab_size))
    decode_ms = decode_step_ms(model)
    cached_ms, _ = median_ms(
        lambda: mx.eval(mx.where(index.masks([index.start]), logits, -mx.inf)), 200
    )
    cold = []
    for state in range(0, index.num_states, max(1, index.num_states // 200)):
        tic = time.perf_counter()
        index.row(state)
        cold.append(time.perf_counter() - tic)
    cold_ms = statistics.mean(cold) * 1e3
    return (
        f"mask cost per step: {cached_ms:.3f} ms cached = {100 * cached_ms / decode_ms:.2f}% of a "
        f"{decode_ms:.1f} ms step; first visit of a state adds {cold_ms:.2f} ms on average "
        f"({100 * cold_ms / decode_ms:.1f}%, {len(cold)} states sampled)"
    )


def invalid_walks(schema, dfa, walks: int) -> str:
    """How many of `walks` random members of the DFA's language fail `jsonschema` (formats on)."""
    try:
        validator = validator_for(schema)
    except ImportError:
        return "-"
    import random

    rng = random.Random(0)
    texts = [text for text in (dfa.sample(rng) for _ in range(walks)) if text is not None]
    return f"{sum(not validator.is_valid(json.loads(text)) for text in texts)}/{len(texts)}"


def coverage(walks: int = 300) -> str:
    """Share of the realistic schemas served (the rest must be refused in one line, quickly), and
    how many random walks of each served one's DFA fail validation (must be 0)."""
    lines = ["| schema | result | DFA states | s | invalid walks |", "|---|---|---:|---:|---:|"]
    served = 0
    schemas = load_schemas("realistic")
    for name, schema in schemas.items():
        tic = time.perf_counter()
        try:
            dfa = compile_regex(schema_to_regex(schema))
            served += 1
            result, states = "served", str(dfa.num_states)
        except RegexError as error:
            result, states, dfa = f"refused: {error}", "-", None
        seconds = time.perf_counter() - tic
        invalid = invalid_walks(schema, dfa, walks) if dfa is not None else "-"
        lines.append(f"| {name} | {result} | {states} | {seconds:.2f} | {invalid} |")
    lines.append(
        f"\nserved {served}/{len(schemas)} ({served / len(schemas):.0%}); the rest refused with "
        "one line"
    )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description="JSON Schema constrained decoding benchmark.")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--coverage-only", action="store_true")
    args = parser.parse_args()
    header = (
        f"{datetime.date.today()} · {platform.node() or 'this machine'} · {describe_backend()} · "
        f"SmolLM2-135M-Instruct {default_dtype()} · greedy · max {args.max_tokens} new tokens · "
        f"mlx {mx.__version__}"
    )
    print(header)
    report = "## Coverage of realistic schemas\n\n" + coverage()
    print(report)
    if not args.coverage_only:
        model, tokenizer, _ = load_model()
        report = "## JSON suite\n\n" + suite(model, tokenizer, args) + "\n\n" + report
        print(report)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "json_schema.md").write_text(f"{header}\n\n{report}\n")


if __name__ == "__main__":
    main()
