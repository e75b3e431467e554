"""The verification-cost model: fitted from the loop's own timings, and read by every choice."""

import mlx.core as mx
import numpy as np
import pytest

from decoder import DecodingStats, generate_step
from decoder.pass_cost import PassCost
from draft_model import DraftModel
from prompt_lookup import PromptLookupSource
from tests.helpers import tiny_llama

TARGET = tiny_llama(vocab_size=32, seed=4)


def cycle_model(cycle):
    """A Llama whose greedy next token after ``cycle[i]`` is ``cycle[i + 1]``, round the cycle:
    one-hot embeddings, layers that add nothing, and an output layer that permutes."""
    vocab = len(cycle)
    model = tiny_llama(vocab_size=vocab, hidden_size=vocab)
    model.model.embed_tokens.weight = mx.eye(vocab)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    permute = np.zeros((vocab, vocab), np.float32)
    permute[np.roll(cycle, -1), cycle] = 10.0
    model.lm_head.weight = mx.array(permute)
    return model


class SimulatedCost:
    """The model on a simulated clock: a pass of width w takes ``base + per_token * (w - 1)``.
    A model's drafting step takes ``draft_step`` (set for a draft model wrapped the same way)."""

    def __init__(self, model, base=1.0, per_token=0.1, clock=None):
        self.model, self.base, self.per_token = model, base, per_token
        self.clock = clock or self
        self.now = 0.0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, inputs, cache=None):
        self.clock.now += self.base + self.per_token * (inputs.shape[1] - 1)
        return self.model(inputs, cache=cache)

    def time(self) -> float:
        return self.clock.now


def test_the_fit_recovers_a_measured_line_and_starts_from_the_prior():
    cost = PassCost(default_token_cost=0.09)
    assert cost.token_cost() == pytest.approx(0.09) and cost.seconds() is None
    for _ in range(30):
        for width in (1, 3, 5):
            cost.record(0.05 * (1 + 0.3 * (width - 1)), width)
    assert cost.token_cost() == pytest.approx(0.3, abs=0.01)
    assert cost.seconds(9) == pytest.approx(0.05 * (1 + 0.3 * 8), rel=0.02)
    # Only one width measured at 8 rows: the slope measured at the nearest size (1 row), on the
    # measured base.
    cost.record(0.2, 1, rows=8)
    assert cost.relative(5, rows=8) == pytest.approx(1 + 4 * 0.3, rel=0.02)
    assert cost.summary()["token_cost"][1] == pytest.approx(0.3, abs=0.01)
    # The nearest size with a measured slope lends it: 8 rows' timings alone (1.5 a width) to 9
    # rows.
    for _ in range(30):
        cost.record(0.2 * (1 + 1.5 * 4), 5, rows=8)
    cost.record(0.25, 1, rows=9)
    assert cost.relative(2, rows=9) == pytest.approx(2.5, rel=0.02)
    assert cost.relative(2, rows=8) > 2


def test_a_size_with_one_width_takes_the_prior_until_another_size_has_a_slope():
    cost = PassCost(default_token_cost=0.09)
    cost.record(0.1, 1, rows=1)
    cost.record(0.3, 1, rows=8)
    assert cost.relative(3, rows=8) == pytest.approx(1 + 2 * 0.09)
    # As rows join, sizes are met with one width timed; once 4 rows have a slope, 8 and 1 take it.
    cost.record(0.2, 1, rows=4)
    cost.record(0.2 * 1.8, 3, rows=4)
    assert cost.relative(3, rows=8) > 1 + 2 * 0.3
    assert cost.relative(3, rows=1) == pytest.approx(cost.relative(3, rows=8))


def test_drafting_cost_is_measured_against_a_step():
    cost = PassCost()
    assert cost.draft_cost("draft_model", prior=0.4) == 0.4  # nothing timed yet
    cost.record(0.1, 1)
    cost.record_draft("draft_model", 0.06, 3)  # 20 ms per drafted token on a 100 ms step
    assert cost.draft_cost("draft_model", prior=0.4) == pytest.approx(0.2)


def run_simulated(base, per_token, sources, prompt, max_tokens=48, target=TARGET):
    model = SimulatedCost(target, base, per_token)
    stats = DecodingStats()
    tokens = [
        t
        for t, _ in generate_step(
            prompt,
            model,
            draft_sources=sources,
            eos_token_ids=(),
            max_tokens=max_tokens,
            stats=stats,
            pass_cost=PassCost(clock=model.time),
        )
    ]
    return tokens, stats


def test_cheap_verification_drafts_longer_copies_and_takes_fewer_passes():
    """The same prompt-lookup policy on two cost curves: verifying nearly free (as on a GPU)
    must draft longer and verify less often than verifying at half a step per token."""
    rng = np.random.default_rng(0)
    cycle = rng.permutation(32)
    target = cycle_model(cycle)
    # The prompt goes round the cycle with every fifth token wrong, so a copy from it is
    # accepted about 4 tokens in 5; the output stays within one round (never copies itself).
    prompt = cycle.copy()
    prompt[2::5] = rng.integers(0, 32, size=prompt[2::5].size)
    prompt = prompt.tolist()
    plain, _ = run_simulated(1.0, 0.1, [], prompt, max_tokens=30, target=target)
    assert plain == cycle[:30].tolist()  # the model follows its cycle
    outputs, passes, longest = {}, {}, {}
    for name, per_token in (("gpu-like", 0.005), ("costly", 0.5)):
        tokens, stats = run_simulated(
            1.0, per_token, [PromptLookupSource(num_draft=4)], prompt, max_tokens=30, target=target
        )
        outputs[name], passes[name] = tokens, stats.target_forward_passes / len(tokens)
        longest[name] = len(stats.source("prompt_lookup").proposed_at)
        # measured, with its prior
        assert stats.pass_cost.token_cost() == pytest.approx(per_token, rel=0.3)
    assert outputs["gpu-like"] == outputs["costly"] == plain
    assert longest["gpu-like"] > longest["costly"]
    assert passes["gpu-like"] < passes["costly"]


def test_a_draft_model_pauses_when_its_measured_drafting_does_not_pay():
    """A draft model's drafting time is measured too: a perfect draft (the target itself) that
    drafts slower than a target step pauses; nearly free, it keeps drafting. Output identical."""
    prompt = [1, 2, 3, 4]
    plain, _ = run_simulated(1.0, 0.1, [], prompt)
    passes = {}
    for name, draft_step in (("cheap", 0.01), ("slow", 3.0)):
        model = SimulatedCost(TARGET, 1.0, 0.05)
        draft = SimulatedCost(TARGET, draft_step, 0.0, clock=model)
        source = DraftModel(draft, 32, num_draft=3, min_confidence=0.0).source()
        stats = DecodingStats()
        tokens = [
            t
            for t, _ in generate_step(
                prompt,
                model,
                draft_sources=[source],
                eos_token_ids=(),
                max_tokens=48,
                stats=stats,
                pass_cost=PassCost(clock=model.time),
            )
        ]
        assert tokens == plain
        passes[name] = stats.target_forward_passes
    # of 48 tokens: long drafts, or mostly plain steps
    assert passes["cheap"] < 12 and passes["slow"] > 30
