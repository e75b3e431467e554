"""The draft head against plain decoding, mlx-lm's speculative decoding and our draft model.

    python -m benchmarks.run --suite draft_head --temps 0 --prompts-per-class 3 --max-tokens 96
    python -m benchmarks.run --suite draft_head_cost

Prompts: benchmarks/heldout/chat.txt (open-ended chat written for this benchmark; no line of it
is an instruction the training generator can produce, see tests/test_draft_head.py), plus the
open-ended and extractive-QA classes of benchmarks/prompts/ (never used for training).
"""

import time

import mlx.core as mx

from benchmarks.harness import (
    Method,
    heldout_prompts,
    load_prompts,
    markdown_table,
    side_by_side,
    time_loop,
)
from decoder.row import SourceStats
from decoder.sampling import Sampling
from decoder.text import eos_ids_of


class Recorded:
    """A source that also adds its drafts to a shared ``SourceStats`` (acceptance by position)."""

    def __init__(self, source, stats: SourceStats):
        self.source, self.stats, self.name = source, stats, source.name

    # everything else is the source's (forecasts, a batch's questions)
    def __getattr__(self, name):
        return getattr(self.source, name)

    def reset(self, *args, **kwargs):
        self.source.reset(*args, **kwargs)

    def propose(self, tokens, max_draft, max_nodes=None):
        return self.source.propose(tokens, max_draft, max_nodes)

    def update(self, tokens, num_proposed, num_accepted):
        if num_proposed:
            self.stats.record(num_proposed, num_accepted)
        self.source.update(tokens, num_proposed, num_accepted)


def draft_head_suite(model, tokenizer, args):
    from mlx_lm import load

    from benchmarks.harness import first_prompts, self_draft_path

    prompts = {
        "heldout_chat": heldout_prompts(tokenizer),
        **load_prompts(tokenizer, ["open_ended", "extractive_qa"]),
    }
    if args.classes:
        prompts = {task: items for task, items in prompts.items() if task in args.classes}
    prompts = first_prompts(prompts, args.prompts_per_class)
    self_draft, _ = load(self_draft_path(args.draft_layers[0]))
    results, by_position = {}, {}
    for temp in args.temps:
        methods = suite_methods(model, tokenizer, args, self_draft, temp, by_position)
        for task, by_method in side_by_side(
            model, tokenizer, prompts, methods, args.max_tokens
        ).items():
            results[f"{task}, temp {temp}"] = by_method
    return markdown_table(results, "plain") + "\n" + acceptance_by_position(by_position), None


def suite_methods(model, tokenizer, args, self_draft, temp: float, by_position: dict) -> list:
    """The methods compared at ``temp``: plain, mlx-lm's and our draft model, the head three ways,
    prompt lookup alone and with the head; the head's methods record into ``by_position``."""
    from benchmarks.harness import mlx_lm_speculative_runner
    from draft_head.source import HeadDrafter
    from draft_model import DraftModel
    from prompt_lookup import PromptLookupSource

    greedy, eos, num_layers = temp == 0, eos_ids_of(tokenizer), args.draft_layers[0]
    sampling = Sampling(temp)

    def head_method(name, lookup=False, **options):
        stats = by_position.setdefault(f"{name}, temp {temp}", SourceStats())

        def run(prompt, max_tokens):
            # The loop runs on the tap, so this method times the loop itself.
            tap, drafter = HeadDrafter.create(model, args.head, **options)
            source = drafter.source()
            sources = (
                [PromptLookupSource(), Recorded(source, stats)]
                if lookup
                else [Recorded(source, stats)]
            )
            return time_loop(tap, prompt, max_tokens, eos, sampling=sampling, draft_sources=sources)

        return Method(name, run=run, greedy=greedy)

    return [
        Method("plain", lambda prompt: {"sampling": sampling}, greedy=greedy),
        Method(
            f"mlx-lm speculative, self-draft {num_layers} layers, k=4",
            run=mlx_lm_speculative_runner(model, tokenizer, self_draft, 4, temp),
            greedy=greedy,
        ),
        Method(
            f"draft model ({num_layers} layers), adaptive",
            lambda prompt: {
                "sampling": sampling,
                "draft_sources": [
                    DraftModel.create(self_draft, tokenizer, model, tokenizer).source()
                ],
            },
            greedy=greedy,
        ),
        head_method("head, k=4 fixed", num_draft=4, adaptive=False),
        head_method("head, k=2 fixed", num_draft=2, adaptive=False),
        head_method("head, adaptive"),
        Method(
            "prompt lookup",
            lambda prompt: {"sampling": sampling, "draft_sources": [PromptLookupSource()]},
            greedy=greedy,
        ),
        head_method("prompt lookup + head", lookup=True),
    ]


def acceptance_by_position(by_position: dict) -> str:
    """A markdown table of each head method's acceptance rate at each draft position."""
    lines = [
        "",
        "Head acceptance by draft position (all prompts):",
        "",
        "| method | drafts | mean accepted | by position |",
        "|---|---:|---:|---|",
    ]
    for name, stats in by_position.items():
        summary = stats.summary()
        positions = ", ".join(f"{r:.2f}" for r in summary["acceptance_by_position"][:8])
        lines.append(
            f"| {name} | {stats.drafts} | {summary['mean_accepted_length']:.2f} | {positions} |"
        )
    return "\n".join(lines)


def draft_head_cost_suite(model, tokenizer, args, repeats: int = 40):
    """One draft step (head + sub-vocabulary scores + argmax + sync) vs one target step,
    interleaved."""
    from mlx_lm.models.cache import make_prompt_cache

    from decoder.hidden_states import body_with_features, output_weight
    from draft_head.loading import load_head

    head, vocab_ids = load_head(args.head, model)
    prompt = heldout_prompts(tokenizer)[0][1]
    cache, head_cache = make_prompt_cache(model), head.make_cache()
    hidden, features = body_with_features(model, mx.array(prompt)[None], head.feature_layers, cache)
    embed = model.model.embed_tokens
    head(features[:, :-1], embed(mx.array(prompt[1:])[None]), cache=head_cache)
    # The head's ids are ranked by frequency: its first n rows are the n-token sub-vocabulary.
    sizes = [n for n in (2048, 4096) if n < vocab_ids.size] + [vocab_ids.size]
    rows = {
        f"sub-vocabulary {n}": mx.take(output_weight(model), vocab_ids[:n], axis=0) for n in sizes
    }
    rows["full vocabulary"] = output_weight(model)
    feature = hidden[:, -1:]
    token = mx.array([[prompt[-1]]])

    def target_step():
        logits = model(token, cache=cache)
        mx.argmax(logits[0, -1]).item()
        for c in cache:
            c.trim(1)

    def draft_step(out_rows, feature=feature):
        predicted = head(feature, embed(token), cache=head_cache)
        mx.argmax(predicted[0, -1] @ out_rows.T).item()
        for c in head_cache:
            c.trim(1)

    steps = {
        "target step": target_step,
        **{f"head step, {k}": (lambda r=r: draft_step(r)) for k, r in rows.items()},
    }
    times = {name: [] for name in steps}
    for _ in range(3):  # warm-up
        for step in steps.values():
            step()
    for _ in range(repeats):
        for name, step in steps.items():
            tic = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - tic)
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    lines = ["| step | median ms | fraction of a target step |", "|---|---:|---:|"]
    for name, seconds in median.items():
        lines.append(f"| {name} | {1000 * seconds:.2f} | {seconds / median['target step']:.3f} |")
    return "\n".join(lines), None


def draft_head_misses_suite(model, tokenizer, args):
    """Where the head's misses go, teacher-forced on the target's own greedy answers to the
    held-out chat prompts: accuracy at draft depth 1 and 2 by how frequent the right token is."""
    from decoder import generate_step
    from decoder.hidden_states import body_with_features, output_weight
    from draft_head.loading import load_head
    from head_training.train import unrolled_predictions

    head, vocab_ids = load_head(args.head, model)
    rank = {token: i for i, token in enumerate(vocab_ids.tolist())}
    out_rows = mx.take(output_weight(model), vocab_ids, axis=0)
    buckets = [(0, 1024), (1024, 4096), (4096, vocab_ids.size), (vocab_ids.size, None)]
    hits = {depth: {b: [0, 0] for b in buckets} for depth in (1, 2)}
    for _, prompt in heldout_prompts(tokenizer)[: args.prompts_per_class or None]:
        answer = [
            t
            for t, _ in generate_step(
                prompt, model, max_tokens=args.max_tokens, eos_token_ids=eos_ids_of(tokenizer)
            )
        ]
        text = prompt + answer
        _, features = body_with_features(model, mx.array(text)[None], head.feature_layers)
        # Depth 2 reads depth 1's predictions and attends as drafting does.
        predictions = unrolled_predictions(
            head, features, model.model.embed_tokens(mx.array(text)[None]), 2
        )
        for depth, predicted in enumerate(predictions, start=1):
            guesses = vocab_ids[mx.argmax(predicted[0] @ out_rows.T, axis=-1)].tolist()
            for position, guess in enumerate(guesses):
                index = position + depth + 1  # the token this prediction scores
                if index < len(prompt) or index >= len(text):
                    continue
                right = text[index]
                bucket = next(
                    b for b in buckets if b[1] is None or rank.get(right, vocab_ids.size) < b[1]
                )
                hits[depth][bucket][0] += guess == right
                hits[depth][bucket][1] += 1
    lines = [
        "| right token's frequency rank | answer tokens | depth 1 accuracy | depth 2 accuracy |",
        "|---|---:|---:|---:|",
    ]
    for bucket in buckets:
        label = f"{bucket[0]}-{bucket[1]}" if bucket[1] else "outside the sub-vocabulary"
        count = hits[1][bucket][1]
        accuracy = [f"{hits[d][bucket][0] / max(hits[d][bucket][1], 1):.1%}" for d in (1, 2)]
        lines.append(f"| {label} | {count} | {accuracy[0]} | {accuracy[1]} |")
    total = [
        sum(h[0] for h in hits[d].values()) / max(sum(h[1] for h in hits[d].values()), 1)
        for d in (1, 2)
    ]
    lines.append(
        f"| all | {sum(h[1] for h in hits[1].values())} | {total[0]:.1%} | {total[1]:.1%} |"
    )
    return "\n".join(lines), None
