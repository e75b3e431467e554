"""Logits processors and sampling truncations (issue #50): greedy output equals mlx-lm's
generate_step with the same processors, whatever drafts, alone and in a batch; sampling with drafts
keeps the processed, truncated distribution (chi-square against a brute-force oracle), and the same
check rejects a loop that verifies against the unprocessed one."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step as mlx_generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from batch import BatchGenerator
from decoder import DecodingStats, Draft, Sampling, generate_step
from draft_model import DraftModel
from prompt_lookup import PromptLookupSource
from tests.helpers import ScriptedSource, chi_square_p_value, tiny_llama
from tests.test_decoder import ResidueConstraint

VOCAB = 64
TARGET = tiny_llama(vocab_size=VOCAB, num_layers=2, seed=0)
DRAFT = tiny_llama(vocab_size=VOCAB, num_layers=1, seed=5)
MAX_TOKENS = 14


def mlx_lm_greedy(prompt, processors, max_tokens=MAX_TOKENS):
    """mlx-lm's own greedy tokens with ``processors``."""
    steps = mlx_generate_step(
        mx.array(prompt), TARGET, max_tokens=max_tokens, logits_processors=processors
    )
    return [token for token, _ in steps]


def residue_processor(prompt_length):
    """``ResidueConstraint`` as an mlx-lm processor: the n-th generated token is n modulo 4."""

    def processor(tokens, logits):
        position = len(tokens) - prompt_length
        allowed = mx.arange(logits.shape[-1]) % 4 == position % 4
        return mx.where(allowed, logits, -mx.inf)

    return processor


processor_settings = st.fixed_dictionaries(
    {
        "logit_bias": st.one_of(
            st.none(),
            st.dictionaries(
                st.integers(0, VOCAB - 1), st.floats(-100, 100, allow_nan=False), max_size=4
            ),
        ),
        "repetition_penalty": st.one_of(st.none(), st.floats(0.5, 3.0)),
        "repetition_context_size": st.integers(1, 30),
        "presence_penalty": st.one_of(st.none(), st.floats(-2.0, 2.0)),
        "presence_context_size": st.integers(1, 30),
        "frequency_penalty": st.one_of(st.none(), st.floats(-2.0, 2.0)),
        "frequency_context_size": st.integers(1, 30),
    }
)
# repetitive prompts, so that prompt lookup has copies to draft
prompts = st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=6).flatmap(
    lambda unit: st.integers(1, 4).map(lambda times: unit * times)
)


def sources_of(kind):
    if kind == "lookup":
        return [PromptLookupSource()], None
    if kind == "draft model":
        return [DraftModel(DRAFT, VOCAB, num_draft=3).source()], None
    return [PromptLookupSource()], ResidueConstraint(VOCAB)


@pytest.mark.parametrize("kind", ["lookup", "draft model", "constraint"])
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(prompt=prompts, options=processor_settings)
def test_greedy_with_processors_equals_mlx_lm(kind, prompt, options):
    sources, constraint = sources_of(kind)
    processors = make_logits_processors(**options)
    expected = mlx_lm_greedy(
        prompt, processors + ([residue_processor(len(prompt))] if constraint else [])
    )
    stats = DecodingStats()
    tokens = [
        token
        for token, _ in generate_step(
            prompt,
            TARGET,
            draft_sources=sources,
            constraint=constraint,
            logits_processors=processors,
            max_tokens=MAX_TOKENS,
            eos_token_ids=(),
            stats=stats,
        )
    ]
    assert tokens == expected


def test_drafts_are_verified_under_the_processors():
    """The property above is not vacuous: an oracle's drafts of mlx-lm's own output are accepted
    whole, each position processed with the draft tokens before it."""
    prompt = [3, 9, 4, 1] * 4
    processors = make_logits_processors(
        frequency_penalty=0.3, repetition_penalty=1.3, logit_bias={7: 2.0}
    )
    expected = mlx_lm_greedy(prompt, processors, 24)
    oracle = ScriptedSource(lambda tokens, k: expected[len(tokens) - len(prompt) :][:k])
    stats = DecodingStats()
    tokens = [
        token
        for token, _ in generate_step(
            prompt,
            TARGET,
            draft_sources=[oracle],
            logits_processors=processors,
            max_tokens=24,
            eos_token_ids=(),
            stats=stats,
        )
    ]
    assert tokens == expected
    assert stats.draft_accepted == stats.draft_proposed > 0
    assert stats.target_forward_passes < 12


def test_a_batch_gives_each_row_its_own_processors():
    """Rows of one batch, each with its own processors, sampling settings and sources: every
    greedy row equals mlx-lm's output for that row alone."""
    rows = [
        ([3, 9, 4, 1] * 3, dict(repetition_penalty=1.5, repetition_context_size=6)),
        ([5, 6, 7], dict(logit_bias={11: 5.0, 12: -100.0})),
        ([8, 2, 8, 2, 8, 2], dict(presence_penalty=1.0, frequency_penalty=0.5)),
        ([1, 2, 3, 4, 5], {}),
    ]
    processors = [make_logits_processors(**options) for _, options in rows]
    generator = BatchGenerator(TARGET, eos_token_ids=())
    uids = generator.insert(
        [prompt for prompt, _ in rows],
        draft_sources=[[PromptLookupSource()], [], [DraftModel(DRAFT, VOCAB).source()], []],
        logits_processors=processors,
        # a truncation does not change a greedy row
        sampling=[Sampling(), Sampling(top_k=5), Sampling(min_p=0.3), Sampling(top_k=2)],
        max_tokens=MAX_TOKENS,
    )
    outputs = {uid: [] for uid in uids}
    while responses := generator.next():
        for response in responses:
            assert response.finish_reason != "error", response.error
            outputs[response.uid] += response.tokens
    for uid, (prompt, _), row_processors in zip(uids, rows, processors):
        assert outputs[uid] == mlx_lm_greedy(prompt, row_processors), f"row {uid}"


def test_the_vectorized_processors_equal_mlx_lms_at_every_position():
    """decoder.make_logits_processors over a pass's W positions at once: each position, bit for
    bit, what mlx-lm's own processors give it with the tokens before it (float32 and bfloat16)."""
    from decoder import process_logits
    from decoder.processors import make_logits_processors as ours

    rng = np.random.default_rng(0)
    for trial in range(60):
        tokens = rng.integers(0, 12, int(rng.integers(0, 30))).tolist()
        draft = rng.integers(0, 12, int(rng.integers(0, 8))).tolist()
        dtype = (mx.float32, mx.bfloat16)[trial % 2]
        logits = mx.array(rng.normal(size=(len(draft) + 1, 40)) * 3).astype(dtype)
        settings = dict(
            logit_bias={3: 2.0, 7: -1.5},
            repetition_penalty=float(rng.uniform(0.5, 2)),
            repetition_context_size=int(rng.integers(0, 6)),
            presence_penalty=float(rng.uniform(-2, 2)),
            presence_context_size=int(rng.integers(0, 6)),
            frequency_penalty=float(rng.uniform(-2, 2)),
            frequency_context_size=int(rng.integers(0, 25)),
        )
        got = process_logits(ours(**settings), tokens, draft, logits)
        context = tokens + draft
        for position in range(len(draft) + 1):
            want = logits[position : position + 1]
            for processor in make_logits_processors(**settings):
                want = processor(mx.array(context[: len(tokens) + position]), want)
            assert got.dtype == want.dtype
            assert mx.array_equal(got[position : position + 1], want).item(), (trial, position)
        # called as mlx-lm calls a processor: the one position after the tokens
        (last,) = ours(frequency_penalty=0.5, frequency_context_size=4)
        alone = make_logits_processors(frequency_penalty=0.5, frequency_context_size=4)[0]
        row = logits[:1]
        assert mx.array_equal(last(mx.array(context), row), alone(mx.array(context), row)).item()


# --- sampling keeps the processed distribution ---------------------------------------------

SMALL_VOCAB = 10
SMALL = tiny_llama(vocab_size=SMALL_VOCAB, num_layers=1, seed=3, sharp=2.0)
PROMPT = [1, 2, 3]


def oracle_probs(logits, temp, top_k=0, min_p=0.0, xtc_probability=0.0, xtc_threshold=0.1):
    """The distribution mlx-lm's ``make_sampler`` draws from, written again in numpy: min-p on the
    distribution at temperature 1, XTC's two branches mixed, top-k, then temperature."""
    logprobs = np.asarray(logits, np.float64)
    logprobs = logprobs - np.log(np.exp(logprobs - logprobs.max()).sum()) - logprobs.max()
    if min_p > 0:
        logprobs = np.where(logprobs < logprobs.max() + np.log(min_p), -np.inf, logprobs)

    def finish(kept):
        if top_k:
            kept = np.where(kept < np.sort(kept)[-top_k], -np.inf, kept)
        weights = np.exp((kept - kept.max()) / temp)
        return weights / weights.sum()

    plain = finish(logprobs)
    if not xtc_probability:
        return plain
    probs = np.exp(logprobs) / np.exp(logprobs).sum()
    above = probs[probs > xtc_threshold]
    removed = probs > (above.min() if len(above) else np.inf)
    return (1 - xtc_probability) * plain + xtc_probability * finish(
        np.where(removed, -np.inf, logprobs)
    )


def processed_joint(processors, temp, **truncations):
    """p(t1) p(t2 | t1) under the processors and truncations, by brute force."""

    def probs(context):
        logits = SMALL(mx.array([context]))[0, -1:]
        for processor in processors:
            logits = processor(mx.array(context), logits)
        return oracle_probs(np.array(logits[0]), temp, **truncations)

    first = probs(PROMPT)
    return np.stack([first[t] * probs(PROMPT + [t]) for t in range(SMALL_VOCAB)]).reshape(-1)


def random_source(rng):
    """Two tokens from a fixed q unlike the target's, as a draft model's are."""
    q = rng.dirichlet(np.ones(SMALL_VOCAB))
    return ScriptedSource(
        lambda tokens, k: rng.choice(SMALL_VOCAB, size=min(k, 2), p=q).tolist(),
        name="random",
        probs_fn=lambda tokens, draft: mx.array(np.tile(q, (len(draft), 1)), mx.float32),
    )


def sampled_counts(runs=2000, temp=1.0, processors=(), **truncations):
    rng, stats = np.random.default_rng(0), DecodingStats()
    source = random_source(rng)
    mx.random.seed(7)
    counts = np.zeros(SMALL_VOCAB * SMALL_VOCAB, dtype=np.int64)
    for _ in range(runs):
        first, second = (
            token
            for token, _ in generate_step(
                PROMPT,
                SMALL,
                draft_sources=[source],
                sampling=Sampling(temp, **truncations),
                logits_processors=list(processors),
                max_tokens=2,
                eos_token_ids=(),
                stats=stats,
            )
        )
        counts[first * SMALL_VOCAB + second] += 1
    assert 0 < stats.draft_accepted < stats.draft_proposed
    return counts


CONTROLS = {
    "top_k": dict(top_k=3),
    "min_p": dict(min_p=0.15),
    "xtc": dict(xtc_probability=0.5, xtc_threshold=0.1),
    "repetition_penalty": dict(processors=make_logits_processors(repetition_penalty=3.0)),
    "logit_bias": dict(processors=make_logits_processors(logit_bias={4: 3.0, 0: -2.0})),
}


@pytest.mark.parametrize("control", CONTROLS)
def test_sampling_with_drafts_keeps_the_processed_distribution(control):
    options = dict(CONTROLS[control])
    processors = options.pop("processors", [])
    joint = processed_joint(processors, 0.8, **options)
    counts = sampled_counts(temp=0.8, processors=processors, **options)
    assert chi_square_p_value(counts, joint) > 1e-3


def rejects(counts, joint) -> bool:
    """Whether the chi-square check fails: a poor fit, or a token the oracle gives nothing."""
    try:
        return chi_square_p_value(counts, joint) < 1e-3
    except AssertionError:  # a token with zero probability was sampled
        return True


def test_the_check_rejects_verifying_against_the_unprocessed_distribution():
    """The same chi-square check fails a loop that leaves the processors out of verification, or
    verifies against a looser truncation."""
    processors = make_logits_processors(repetition_penalty=3.0)
    assert rejects(sampled_counts(temp=0.8), processed_joint(processors, 0.8))
    assert rejects(sampled_counts(temp=0.8, top_k=6), processed_joint([], 0.8, top_k=3))


@pytest.mark.parametrize("control", ["top_k", "min_p", "xtc"])
def test_the_oracle_is_mlx_lms_sampler(control):
    """``Sampling.probs`` and the numpy oracle agree, and mlx-lm's sampler draws from them."""
    options = CONTROLS[control]
    logits = SMALL(mx.array([PROMPT]))[0, -1]
    probs = np.array(Sampling(0.8, **options).probs(logits[None])[0])
    np.testing.assert_allclose(probs, oracle_probs(np.array(logits), 0.8, **options), atol=1e-5)
    sampler = make_sampler(temp=0.8, **options)
    logprobs = (logits - mx.logsumexp(logits))[None]
    mx.random.seed(0)
    # apply_xtc draws one coin per call, for the whole batch: one draw per call
    draws = [sampler(logprobs).item() for _ in range(3000)]
    counts = np.bincount(draws, minlength=SMALL_VOCAB)
    assert chi_square_p_value(counts, probs) > 1e-3


def test_a_point_mass_draft_is_verified_against_the_truncated_distribution():
    """A copied token top-k removes is always rejected: p gives it nothing."""
    logits = SMALL(mx.array([PROMPT]))[0, -1]
    least = int(mx.argmin(logits).item())
    from decoder import accept_draft

    rows = mx.broadcast_to(logits, (2, SMALL_VOCAB))
    for _ in range(50):
        num_accepted, token = accept_draft(rows, Draft([least]), Sampling(1.0, top_k=3))
        assert num_accepted == 0 and token != least


# Two kinds of rows sampled side by side in one batch, each with its own controls and seed.
BATCH_CONTROLS = [
    dict(top_k=3, processors=make_logits_processors(repetition_penalty=3.0)),
    dict(min_p=0.15, processors=make_logits_processors(logit_bias={4: 3.0, 0: -2.0})),
]


def batch_counts(runs=1200, temp=0.8, batch=300) -> list:
    """Per kind of BATCH_CONTROLS: the counts of its rows' (first, second) tokens, the kinds
    alternating in batches of ``batch`` rows, each row with a source and a seed of its own."""
    rng, kinds = np.random.default_rng(1), len(BATCH_CONTROLS)
    counts = [np.zeros(SMALL_VOCAB * SMALL_VOCAB, dtype=np.int64) for _ in BATCH_CONTROLS]
    proposed = accepted = 0
    for start in range(0, runs * kinds, batch):
        controls = [BATCH_CONTROLS[i % kinds] for i in range(batch)]
        generator = BatchGenerator(SMALL, eos_token_ids=(), max_width=2)
        uids = generator.insert(
            [PROMPT] * batch,
            draft_sources=[[random_source(rng)] for _ in range(batch)],
            sampling=[
                Sampling(temp, top_k=c.get("top_k", 0), min_p=c.get("min_p", 0.0)) for c in controls
            ],
            logits_processors=[c["processors"] for c in controls],
            max_tokens=2,
            seed=list(range(start, start + batch)),
        )
        outputs = {uid: [] for uid in uids}
        while responses := generator.next():
            for response in responses:
                outputs[response.uid] += response.tokens
                if response.stats is not None:
                    proposed += response.stats.draft_proposed
                    accepted += response.stats.draft_accepted
        for index, uid in enumerate(uids):
            first, second = outputs[uid]
            counts[index % kinds][first * SMALL_VOCAB + second] += 1
    assert 0 < accepted < proposed  # the drafts were verified, and not all accepted
    return counts


def test_rows_of_one_batch_each_keep_their_processed_distribution():
    """Rows with different controls, drafts and seeds in one batch: each kind of row follows its
    own processed distribution, and the same check fails it against the other kind's."""
    counts = batch_counts()
    joints = []
    for controls in BATCH_CONTROLS:
        options = {k: v for k, v in controls.items() if k != "processors"}
        joints.append(processed_joint(controls["processors"], 0.8, **options))
    for kind_counts, joint in zip(counts, joints):
        assert chi_square_p_value(kind_counts, joint) > 1e-3
    assert rejects(counts[0], joints[1]) and rejects(counts[1], joints[0])


def test_a_seeded_row_samples_in_a_batch_what_it_samples_alone():
    """A row's draws come from its own seed, whatever the other rows of the batch draw."""
    prompts = [[3, 9, 4, 1] * 3, [5, 6, 7], [8, 2, 8, 2]]
    options = dict(sampling=Sampling(temp=1.0, min_p=0.02), max_tokens=MAX_TOKENS)
    processors = make_logits_processors(repetition_penalty=1.3)
    alone = [
        [
            token
            for token, _ in generate_step(
                prompt, TARGET, eos_token_ids=(), seed=seed, logits_processors=processors, **options
            )
        ]
        for prompt, seed in zip(prompts, (10, 11, 2**64 - 1))
    ]
    assert len({tuple(tokens) for tokens in alone}) == 3
    mx.random.seed(0)  # the global stream plays no part
    generator = BatchGenerator(TARGET, eos_token_ids=())
    uids = generator.insert(
        prompts, seed=[10, 11, 2**64 - 1], logits_processors=[processors] * 3, **options
    )
    outputs = {uid: [] for uid in uids}
    while responses := generator.next():
        for response in responses:
            outputs[response.uid] += response.tokens
    assert [outputs[uid] for uid in uids] == alone


# --- the command line ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--top-k", "-1"], "--top-k must be an integer >= 0"),
        (["--min-p", "1.5"], "--min-p must be in [0, 1]"),
        (["--min-tokens-to-keep", "0"], "--min-tokens-to-keep must be an integer >= 1"),
        (["--xtc-probability", "2"], "--xtc-probability must be in [0, 1]"),
        (["--xtc-threshold", "0.6"], "--xtc-threshold must be in [0, 0.5]"),
        (["--repetition-penalty", "-1"], "--repetition-penalty must be >= 0"),
        (["--frequency-context-size", "-1"], "--frequency-context-size must be >= 0"),
        (["--presence-penalty", "nan"], "--presence-penalty must be a finite number"),
        (["--logit-bias", "{"], "it is not JSON"),
        (["--logit-bias", "[1, 2]"], "a JSON object of token ids"),
        (["--logit-bias", '{"a": 1}'], "'a' is not a token id"),
        (["--logit-bias", '{"1": "up"}'], "the bias of 1 is not a number"),
        (["--logit-bias", '{"1": Infinity}'], "the bias of 1 is not finite"),
    ],
)
def test_bad_sampling_flags_are_one_clear_error(args, fragment):
    import main
    from cli import CliError

    with pytest.raises(CliError) as error:
        main.validate(main.build_parser().parse_args(args))
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_the_sampling_flags_reach_the_loop():
    """The flags become mlx-lm's processors: greedy output is mlx-lm's with the same ones."""
    import main
    from tests.helpers import tiny_byte_tokenizer

    flags = ["--repetition-penalty", "1.4", "--repetition-context-size", "5"]
    flags += ["--presence-penalty", "0.5", "--frequency-penalty", "0.2", "--logit-bias", '{"9": 4}']
    args = main.build_parser().parse_args(flags)
    main.validate(args)
    kwargs = main.sampling_kwargs(args, tiny_byte_tokenizer(), VOCAB)
    assert len(kwargs["logits_processors"]) == 4
    prompt = [3, 9, 4, 1] * 3
    tokens = [
        t for t, _ in generate_step(prompt, TARGET, eos_token_ids=(), max_tokens=12, **kwargs)
    ]
    expected = make_logits_processors(
        logit_bias={9: 4.0},
        repetition_penalty=1.4,
        repetition_context_size=5,
        presence_penalty=0.5,
        frequency_penalty=0.2,
    )
    assert tokens == mlx_lm_greedy(prompt, expected, 12)
    with pytest.raises(Exception, match="outside the vocabulary"):
        main.sampling_kwargs(args, tiny_byte_tokenizer(), 8)


@pytest.mark.parametrize("flag", [["--thinking-budget", "5"], ["--no-thinking"]])
def test_a_thinking_flag_on_a_model_without_think_markers_says_so(flag, capsys):
    import main
    from cli import constraints
    from tests.helpers import tiny_byte_tokenizer

    args = main.build_parser().parse_args(flag)
    main.validate(args)
    tokenizer = tiny_byte_tokenizer()
    assert constraints.build(args, tokenizer, len(tokenizer), [1, 2]) == (None, [])
    note = capsys.readouterr().err
    assert note == f"note: {flag[0]} changes nothing: the model has no think markers\n"


def test_a_draft_model_draws_from_the_processed_distribution():
    """A draft model that is the target, sampling as the target does (its truncations and its
    processors, handed to ``DraftSource.reset``), drafts from q = p: every drafted token is
    accepted, and the two tokens still follow the processed distribution."""
    from draft_model import DraftModel

    processors = make_logits_processors(logit_bias={4: 3.0, 0: -2.0}, repetition_penalty=2.0)
    drafter = DraftModel(SMALL, SMALL_VOCAB, num_draft=2, adaptive=False)
    stats, counts = DecodingStats(), np.zeros(SMALL_VOCAB * SMALL_VOCAB, dtype=np.int64)
    mx.random.seed(5)
    for _ in range(1500):
        first, second = (
            token
            for token, _ in generate_step(
                PROMPT,
                SMALL,
                draft_sources=[drafter.source()],
                sampling=Sampling(0.8, top_k=4),
                logits_processors=list(processors),
                max_tokens=2,
                eos_token_ids=(),
                stats=stats,
            )
        )
        counts[first * SMALL_VOCAB + second] += 1
    assert stats.draft_proposed > 0 and stats.draft_accepted == stats.draft_proposed
    assert chi_square_p_value(counts, processed_joint(processors, 0.8, top_k=4)) > 1e-3
