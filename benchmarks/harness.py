"""Side-by-side timing: every method runs on the same prompts in one process.

Methods are interleaved per prompt (plain, A, B, plain, A, B, ...) after a
warm-up, so slow drift of the machine hits all of them alike. Speed is decode
speed: tokens after the first one over the time since the first one (the
prompt's prefill is reported apart, as mlx-lm does).
"""

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx

from decoder import generate_step
from decoder.row import DecodingStats
from decoder.text import encode, eos_ids_of

PROMPTS = Path(__file__).parent / "prompts"
# Open-ended chat written for the draft head's benchmarks: no line of it is an instruction the
# head's training generator can produce (tests/test_draft_head.py checks).
HELDOUT = Path(__file__).parent / "heldout" / "chat.txt"


@dataclass
class Method:
    """``make`` builds the loop's keyword arguments for one prompt (fresh sources each run)."""

    name: str
    make: Callable = lambda prompt: {}
    run: Optional[Callable] = None  # a custom runner (mlx-lm, transformers): prompt -> tokens
    greedy: bool = True


@dataclass
class Run:
    tokens: list
    decode_time: float
    forward_passes: int
    proposed: int
    accepted: int
    drafts: int
    peak_memory_gb: float


@dataclass
class Totals:
    runs: list = field(default_factory=list)

    def add(self, run: Run):
        self.runs.append(run)

    def sum(self, key):
        return sum(getattr(r, key) for r in self.runs)

    @property
    def tokens(self):
        return sum(len(r.tokens) for r in self.runs)

    @property
    def tps(self):
        return sum(len(r.tokens) - 1 for r in self.runs) / max(self.sum("decode_time"), 1e-9)


def decode_timed(tokens) -> tuple:
    """(the tokens, seconds from the first one to the last): decode time, the prefill left out."""
    collected, first = [], None
    for token in tokens:
        collected.append(token)
        if first is None:
            first = time.perf_counter()
    return collected, time.perf_counter() - first


def time_loop(model, prompt, max_tokens, eos, **kwargs) -> Run:
    stats = DecodingStats()
    mx.reset_peak_memory()
    tokens, seconds = decode_timed(
        token
        for token, _ in generate_step(
            prompt, model, max_tokens=max_tokens, eos_token_ids=eos, stats=stats, **kwargs
        )
    )
    return Run(
        tokens,
        seconds,
        stats.target_forward_passes,
        stats.draft_proposed,
        stats.draft_accepted,
        sum(s.drafts for s in stats.sources.values()),
        mx.get_peak_memory() / 1e9,
    )


def time_custom(run, prompt, max_tokens) -> Run:
    """A runner yields tokens (timed here, one forward pass each), or returns a ``Run`` it timed
    itself."""
    mx.reset_peak_memory()
    output = run(prompt, max_tokens)
    if isinstance(output, Run):
        return output
    tokens, seconds = decode_timed(output)
    return Run(tokens, seconds, len(tokens), 0, 0, 0, mx.get_peak_memory() / 1e9)


def side_by_side(
    model, tokenizer, prompts: dict, methods: list, max_tokens: int, warmup: bool = True, log=print
) -> dict:
    """Returns {task_class: {method_name: Totals}}; prompts is {task_class: [(name, tokens)]}."""
    eos = eos_ids_of(tokenizer)

    def once(method, prompt):
        if method.run is not None:
            return time_custom(method.run, prompt, max_tokens)
        return time_loop(model, prompt, max_tokens, eos, **method.make(prompt))

    if warmup:
        first = next(iter(prompts.values()))[0][1]
        for method in methods:
            once(method, first)
    results = {}
    for task, items in prompts.items():
        results[task] = {m.name: Totals() for m in methods}
        for name, prompt in items:
            reference = None  # greedy methods must all give the first greedy method's tokens
            for method in methods:
                run = once(method, prompt)
                results[task][method.name].add(run)
                if method.greedy and reference is None:
                    reference = run.tokens
                elif method.greedy and run.tokens != reference:
                    log(f"  !! {method.name} differs from the first greedy method on {name}")
                log(
                    f"  {task}/{name} {method.name}: {len(run.tokens)} tokens, "
                    f"{(len(run.tokens) - 1) / max(run.decode_time, 1e-9):.2f} tok/s, "
                    f"{run.forward_passes} passes"
                )
    return results


def markdown_table(results: dict, baseline: str) -> str:
    lines = [
        "| task | method | tok/s | vs plain | passes/token | acceptance | mean accepted | peak GB "
        "|",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for task, by_method in results.items():
        base_tps = by_method[baseline].tps
        for name, totals in by_method.items():
            proposed, accepted, drafts = (
                totals.sum("proposed"),
                totals.sum("accepted"),
                totals.sum("drafts"),
            )
            acceptance = f"{accepted / proposed:.1%}" if proposed else "-"
            mean = f"{accepted / drafts:.2f}" if drafts else "-"
            peak = max(r.peak_memory_gb for r in totals.runs)
            lines.append(
                f"| {task} | {name} | {totals.tps:.2f} | {totals.tps / base_tps:.2f}x | "
                f"{totals.sum('forward_passes') / max(totals.tokens, 1):.3f} | {acceptance} | "
                f"{mean} | {peak:.3f} |"
            )
    return "\n".join(lines)


def chat_tokens(tokenizer, text: str) -> list:
    return encode(tokenizer, text)


def load_prompts(tokenizer, classes=None, chat=True) -> dict:
    """benchmarks/prompts/<task_class>/<name>.txt -> {task_class: [(name, tokens)]}."""
    prompts = {}
    for folder in sorted(p for p in PROMPTS.iterdir() if p.is_dir()):
        if classes and folder.name not in classes:
            continue
        items = []
        for file in sorted(folder.glob("*.txt")):
            text = file.read_text()
            tokens = chat_tokens(tokenizer, text) if chat else tokenizer.encode(text)
            items.append((file.stem, tokens))
        prompts[folder.name] = items
    return prompts


def heldout_prompts(tokenizer) -> list:
    """benchmarks/heldout/chat.txt, one prompt a line -> [(name, tokens)]."""
    lines = [line for line in HELDOUT.read_text().splitlines() if line.strip()]
    return [(f"chat{i}", chat_tokens(tokenizer, line)) for i, line in enumerate(lines)]


def first_prompts(prompts: dict, count: int) -> dict:
    """Keep ``count`` prompts per task class (the slow suites), all when count is None."""
    return {task: items[:count] for task, items in prompts.items()} if count else prompts


def self_draft_path(num_layers: int) -> str:
    """The embedded model cut to its first layers (convert.py --num-layers), cached."""
    from loading.conversion import convert
    from loading.load import default_dtype, embedded_gguf
    from loading.store import cache_dir

    path = cache_dir() / "models" / f"SmolLM2-135M-Instruct-{default_dtype()}-layers{num_layers}"
    if not path.exists():
        convert(str(path), gguf=str(embedded_gguf()), dtype=default_dtype(), num_layers=num_layers)
    return str(path)


def mlx_lm_speculative_runner(model, tokenizer, draft, num_draft, temp):
    """mlx-lm's speculative decoding, which accepts a draft token when a target sample equals it."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    def run(prompt, max_tokens):
        mx.reset_peak_memory()
        tokens, drafted, first = [], 0, None
        for response in stream_generate(
            model,
            tokenizer,
            prompt,
            max_tokens=max_tokens,
            draft_model=draft,
            num_draft_tokens=num_draft,
            sampler=make_sampler(temp=temp),
        ):
            tokens.append(response.token)
            drafted += response.from_draft
            first = first or time.perf_counter()
            if response.finish_reason is not None:
                break
        elapsed = time.perf_counter() - first
        steps = len(tokens) - drafted  # each verification emits one token of the target's own
        return Run(
            tokens, elapsed, steps, steps * num_draft, drafted, steps, mx.get_peak_memory() / 1e9
        )

    return run


def median_ms(call, repeats: int = 3) -> tuple:
    """(median milliseconds of ``repeats`` calls, the last call's result)."""
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - tic)
    return statistics.median(times) * 1e3, result


def decode_step_ms(model) -> float:
    """Median ms of one decoding step (one token, KV cache of 64): what a mask's cost is compared
    with."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.zeros((1, 64), mx.int32), cache=cache)
    step = mx.array([[1]])

    def decode_step():
        mx.eval(model(step, cache=cache))
        for layer in cache:
            layer.trim(1)

    return median_ms(decode_step, 30)[0]
