"""The verify-and-accept loop: losslessness, exact sampling and cache rollback."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import make_prompt_cache

from decoder import TARGET, Constraint, DecodingStats, Draft, Sampling, accept_draft, generate_step
from tests.helpers import (
    ScriptedSource,
    assert_constrained_sampling_is_exact,
    chi_square_p_value,
    tiny_llama,
)

VOCAB = 64
MODEL = tiny_llama(vocab_size=VOCAB)
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def plain_greedy(prompt, max_tokens, eos=()):
    return [t for t, _ in generate_step(prompt, MODEL, max_tokens=max_tokens, eos_token_ids=eos)]


def run(prompt, sources, max_tokens, eos=(), stats=None):
    steps = list(
        generate_step(
            prompt,
            MODEL,
            draft_sources=sources,
            max_tokens=max_tokens,
            eos_token_ids=eos,
            stats=stats,
        )
    )
    return [t for t, _ in steps], [s for _, s in steps]


prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)


@SETTINGS
@given(
    prompt=prompts,
    max_tokens=st.integers(1, 24),
    corrupt=st.lists(st.integers(0, 30), max_size=4),
    num_draft=st.integers(1, 6),
)
def test_greedy_output_is_identical_for_oracle_random_and_partly_right_drafts(
    prompt, max_tokens, corrupt, num_draft
):
    reference = plain_greedy(prompt, max_tokens)
    start = len(prompt)

    def oracle(tokens, max_draft):
        done = len(tokens) - start
        return reference[done : done + min(num_draft, max_draft)]

    def partly_right(tokens, max_draft):
        draft = oracle(tokens, max_draft)
        done = len(tokens) - start
        return [(t + 1) % VOCAB if done + i in corrupt else t for i, t in enumerate(draft)]

    rng = np.random.default_rng(len(prompt) * 131 + max_tokens)

    def random_draft(tokens, max_draft):
        return rng.integers(0, VOCAB, size=min(num_draft, max_draft)).tolist()

    for fn in (oracle, partly_right, random_draft):
        stats = DecodingStats()
        tokens, sources = run(prompt, [ScriptedSource(fn)], max_tokens, stats=stats)
        assert tokens == reference, fn.__name__
        if fn is oracle:
            # Every drafted token is right, so each pass emits num_draft + 1 tokens.
            assert stats.target_forward_passes == -(-max_tokens // (num_draft + 1))
            assert stats.draft_accepted == stats.draft_proposed
            assert sources.count("scripted") == stats.draft_accepted


def test_combined_sources_first_non_empty_wins_and_stay_lossless():
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    reference = plain_greedy(prompt, 30)
    silent = ScriptedSource(lambda tokens, k: [], name="silent")
    wrong = ScriptedSource(lambda tokens, k: [0] * k, name="wrong")
    tokens, _ = run(prompt, [silent, wrong], 30)
    assert tokens == reference
    assert all(proposed == 0 for _, proposed, _ in silent.updates)
    assert any(proposed > 0 for _, proposed, _ in wrong.updates)


class Copier(ScriptedSource):
    """A cheap source whose drafts say what speed-up they expect."""

    def __init__(self, fn, expected, name="copier"):
        super().__init__(fn, name=name)
        self.expected = expected

    def propose(self, tokens, max_draft, max_nodes=None):
        draft = super().propose(tokens, max_draft)
        if draft is not None:
            draft.expected_speedup = self.expected
        return draft


class Modeller(ScriptedSource):
    """A costly source that forecasts its speed-up before it is asked to draft."""

    def __init__(self, fn, forecast, name="modeller"):
        super().__init__(fn, name=name)
        self.forecast = forecast
        self.asked = 0

    def forecast_speedup(self):
        return self.forecast

    def propose(self, tokens, max_draft, max_nodes=None):
        self.asked += 1
        return super().propose(tokens, max_draft)


@pytest.mark.parametrize(
    "copy_expects,model_forecasts,chosen",
    [
        (1.2, 1.5, "modeller"),  # the model expects more: it drafts
        (1.5, 1.2, "copier"),  # the copy expects more: the model is not even run
        (1.5, 1.5, "copier"),  # a tie keeps the cheap copy
        (None, 9.0, "copier"),  # a copy without an estimate wins as before
        (1.2, None, "copier"),  # so does any copy when the model cannot forecast
    ],
)
def test_the_loop_lets_a_model_draft_only_when_it_expects_more(
    copy_expects, model_forecasts, chosen
):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    reference = plain_greedy(prompt, 20)
    start = len(prompt)

    def right(tokens, k):  # both propose the right tokens, so the chosen one is always accepted
        return reference[len(tokens) - start :][:2]

    copier, modeller = Copier(right, copy_expects), Modeller(right, model_forecasts)
    stats = DecodingStats()
    tokens, _ = run(prompt, [copier, modeller], 20, stats=stats)
    assert tokens == reference
    assert list(stats.sources) == [chosen]
    if chosen == "copier":
        assert modeller.asked == 0 and all(proposed == 0 for _, proposed, _ in modeller.updates)
    else:  # the copy's draft was made but not used: it is told it did not draft
        assert all(proposed == 0 for _, proposed, _ in copier.updates)


def test_a_chosen_model_with_no_draft_leaves_the_step_to_the_copy():
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    reference = plain_greedy(prompt, 12)
    copier = Copier(lambda tokens, k: reference[len(tokens) - len(prompt) :][:1], 1.1)
    paused = Modeller(lambda tokens, k: [], 2.0)
    stats = DecodingStats()
    assert run(prompt, [copier, paused], 12, stats=stats)[0] == reference
    assert list(stats.sources) == ["copier"] and paused.asked > 0


def test_stops_at_eos_inside_an_accepted_draft():
    prompt = [7, 7, 7]
    reference = plain_greedy(prompt, 20)
    eos = reference[5]
    expected = reference[: reference.index(eos) + 1]
    start = len(prompt)
    oracle = ScriptedSource(
        lambda tokens, k: reference[len(tokens) - start : len(tokens) - start + k]
    )
    stats = DecodingStats()
    tokens, sources = run(prompt, [oracle], 20, eos=[eos], stats=stats)
    assert tokens == expected == plain_greedy(prompt, 20, eos=[eos])
    # Draft tokens accepted past the EOS are never emitted, so they are not counted either.
    assert stats.draft_accepted == sources.count("scripted")


def test_never_drafts_past_max_tokens():
    seen = []
    source = ScriptedSource(lambda tokens, k: seen.append(k) or [1] * k)
    run([1, 2, 3], [source], 5)
    assert max(seen) <= 4 and all(k >= 1 for k in seen)


def test_rejected_drafts_leave_the_cache_as_a_plain_run_would():
    """Mostly rejected drafts are trimmed off: the cache then holds the prompt and output but
    the last token, and continuing from it scores like a fresh pass over that text."""
    prompt = [5, 3, 8, 1]
    rng = np.random.default_rng(1)
    wrong = ScriptedSource(lambda tokens, k: rng.integers(0, 64, size=min(k, 3)).tolist())
    cache = make_prompt_cache(MODEL)
    stats = DecodingStats()
    out = [
        t
        for t, _ in generate_step(
            prompt,
            MODEL,
            draft_sources=[wrong],
            max_tokens=12,
            eos_token_ids=(),
            prompt_cache=cache,
            stats=stats,
        )
    ]
    assert stats.draft_accepted < stats.draft_proposed  # some drafts were rolled back
    text = prompt + out
    assert cache[0].offset == len(text) - 1
    continued = MODEL(mx.array([text[-1:]]), cache=cache)[0, -1]
    assert mx.allclose(continued, MODEL(mx.array([text]))[0, -1], atol=1e-4)


class ResidueConstraint(Constraint):
    """A constraint written from the protocol's docstrings alone: the n-th token must be n
    modulo 4. Its walk stops at the first forbidden token, as the docstring says."""

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size
        self.reset()

    def reset(self):
        self.position = 0

    def walk(self, draft):
        states = [self.position]
        for token in draft:
            if token % 4 != states[-1] % 4:
                break
            states.append(states[-1] + 1)
        return states

    def masks(self, states):
        return mx.array(
            [[token % 4 == state % 4 for token in range(self.vocab_size)] for state in states]
        )

    def advance(self, tokens):
        self.position += len(tokens)


def test_sampling_stays_exact_under_a_constraint_that_follows_the_protocol():
    """The loop keeps a q-draft's first forbidden token so the target rejects it into (p - q)+;
    a third-party constraint need not know (``constrain_draft``)."""
    model = tiny_llama(vocab_size=128, seed=2, sharp=2.0)
    assert_constrained_sampling_is_exact(model, ResidueConstraint(128))


# --- exact sampling ------------------------------------------------------------------


def _first_token_counts(logits, make_draft, trials, sampling):
    counts = np.zeros(logits.shape[-1], dtype=np.int64)
    for _ in range(trials):
        draft = make_draft()
        rows = mx.broadcast_to(logits, (len(draft.tokens) + 1, logits.shape[-1]))
        num_accepted, next_token = accept_draft(rows, draft, sampling)
        counts[draft.tokens[0] if num_accepted else next_token] += 1
    return counts


@pytest.mark.parametrize("temp,top_p", [(1.0, 1.0), (1.3, 0.8)])
def test_rejection_sampling_keeps_the_target_distribution(temp, top_p):
    mx.random.seed(1)
    vocab = 6
    logits = mx.random.normal((vocab,)) * 1.5
    sampling = Sampling(temp, top_p)
    target = np.array(sampling.probs(logits[None])[0])
    assert (target > 0).sum() >= 3  # top-p must leave a real choice for the test to mean anything
    q = mx.softmax(mx.random.normal((vocab,)) * 1.5)

    def model_draft():  # a draft distribution q with the token drawn from it
        token = mx.random.categorical(mx.log(q)).item()
        return Draft([token], q[None])

    def point_mass():  # an n-gram-style guess with no distribution
        return Draft([int(np.random.randint(vocab))])

    np.random.seed(0)
    for make_draft in (model_draft, point_mass):
        counts = _first_token_counts(logits, make_draft, 6000, sampling)
        assert chi_square_p_value(counts, target) > 1e-3, make_draft.__name__


def test_the_sampling_test_can_fail():
    """Accepting every draft token (a broken rule) must be caught by the same check."""
    mx.random.seed(2)
    vocab = 6
    target = np.array(mx.softmax(mx.random.normal((vocab,)) * 1.5))
    q = np.array(mx.softmax(mx.random.normal((vocab,)) * 1.5))
    rng = np.random.default_rng(0)
    counts = np.bincount(rng.choice(vocab, size=6000, p=q / q.sum()), minlength=vocab)
    assert chi_square_p_value(counts, target) < 1e-3


def test_loop_sampling_with_a_random_draft_model_keeps_the_joint_distribution():
    """Two generated tokens, a draft with its own random distribution, vs. the exact p(t1) p(t2 |
    t1)."""
    vocab = 8
    model = tiny_llama(vocab_size=vocab, seed=3, sharp=2.0)
    prompt = [1, 2, 3]
    p1 = np.array(mx.softmax(model(mx.array([prompt]))[0, -1]))
    nexts = mx.array([prompt + [t] for t in range(vocab)])
    p2 = np.array(mx.softmax(model(nexts)[:, -1], axis=-1))
    joint = (p1[:, None] * p2).reshape(-1)

    mx.random.seed(4)
    q_table = mx.softmax(mx.random.normal((vocab,)) * 2.0)

    def propose(tokens, k):
        return mx.random.categorical(mx.log(q_table), shape=(min(k, 2),)).tolist()

    source = ScriptedSource(
        propose, probs_fn=lambda tokens, draft: mx.broadcast_to(q_table, (len(draft), vocab))
    )
    counts = np.zeros(vocab * vocab, dtype=np.int64)
    stats = DecodingStats()
    for _ in range(2500):
        out = [
            t
            for t, _ in generate_step(
                prompt,
                model,
                draft_sources=[source],
                sampling=Sampling(temp=1.0),
                max_tokens=2,
                eos_token_ids=(),
                stats=stats,
            )
        ]
        counts[out[0] * vocab + out[1]] += 1
    assert chi_square_p_value(counts, joint) > 1e-3
    assert 0 < stats.draft_accepted < stats.draft_proposed


def test_target_tokens_are_labelled_target():
    _, sources = run([1, 2], [], 5)
    assert sources == [TARGET] * 5
