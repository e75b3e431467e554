"""The batched engine: every row gives exactly what it gives alone, with every source and
constraint, while rows of different lengths join and leave; sampling keeps each row's distribution;
one row's failure never touches another; the width policy follows the measured cost of a pass."""

import random
import re

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import batch.generator as batch
from batch import BatchGenerator, batch_generate
from batch.policy import DraftGate, choose_width, prefill_group
from constrained import ForcedTextSource, RegexConstraint
from decoder import TARGET, Sampling, generate_step
from decoder.acceptance import Backoff
from decoder.pass_cost import PassCost
from draft_model import DraftModel
from prompt_lookup.history import HistoryLookupSource
from prompt_lookup.ngram import PromptLookupSource
from tests.helpers import ScriptedSource, chi_square_p_value, tiny_byte_tokenizer, tiny_llama

VOCAB = 64
MODEL = tiny_llama(vocab_size=VOCAB, num_layers=2, hidden_size=32, seed=0)
DRAFT = tiny_llama(vocab_size=VOCAB, num_layers=1, hidden_size=32, seed=1)
EOS = 3


def alone(model, prompt, max_tokens, sources=(), constraint=None, eos=(EOS,), **kwargs):
    return [
        t
        for t, _ in generate_step(
            prompt,
            model,
            eos_token_ids=eos,
            max_tokens=max_tokens,
            draft_sources=list(sources),
            constraint=constraint,
            **kwargs,
        )
    ]


def run(generator, rows, remove_at=None):
    """Insert each row at its ``join`` step and step to the end; returns tokens, finish reason and
    error per row. ``rows``: dicts with prompt, join and insert options; ``remove_at``: {row:
    step}."""
    uids, out, finish, errors, sources = {}, {}, {}, {}, {}
    step = 0
    while step == 0 or len(generator) or any(i not in uids for i in range(len(rows))):
        for i, row in enumerate(rows):
            if row.get("join", 0) == step and i not in uids:
                options = {k: v for k, v in row.items() if k not in ("prompt", "join")}
                options["draft_sources"] = (
                    [options["draft_sources"]] if "draft_sources" in options else None
                )
                uids[i] = generator.insert([row["prompt"]], **options)[0]
        for i, at in (remove_at or {}).items():
            if at == step and i in uids:
                generator.remove([uids[i]])
                finish[uids[i]] = "removed"
        for response in generator.next():
            out.setdefault(response.uid, []).extend(response.tokens)
            sources.setdefault(response.uid, []).extend(response.sources)
            if response.finish_reason is not None:
                finish[response.uid], errors[response.uid] = response.finish_reason, response.error
        step += 1
        assert step < 500
    return (
        [out.get(uids[i], []) for i in range(len(rows))],
        [finish.get(uids[i]) for i in range(len(rows))],
        [errors.get(uids[i]) for i in range(len(rows))],
        [sources.get(uids[i], []) for i in range(len(rows))],
    )


def assert_same_or_near_tie(model, prompt, got, want):
    """Equal, or the first difference is a float near-tie of the two tokens (a batched matmul may
    sum in another order than a single row's)."""
    if got == want:
        return
    at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    logits = model(mx.array([prompt + want[:at]]))[0, -1]
    gap = abs(logits[got[at]].item() - logits[want[at]].item())
    assert gap < 1e-4, f"rows differ at token {at} with a top-2 logit gap of {gap}"


def oracle(truth, prompt_length, rng, corrupt=0.3):
    """Drafts the row's true continuation, a token corrupted now and then: long, ragged
    acceptances."""

    def propose(tokens, k):
        draft = list(truth[len(tokens) - prompt_length :][:k])
        return [rng.randrange(VOCAB) if rng.random() < corrupt else t for t in draft]

    return ScriptedSource(propose, name="oracle")


SOURCE_KINDS = ["none", "prompt_lookup", "history", "oracle", "noise", "draft_model", "self_draft"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(
        st.tuples(
            st.lists(st.integers(0, 15), min_size=1, max_size=40),
            st.integers(1, 30),
            st.integers(0, 4),
            st.sampled_from(SOURCE_KINDS),
        ),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 1000),
    ragged=st.sampled_from([batch.MAX_RAGGEDNESS, 2]),
)
def test_every_row_gives_its_own_greedy_output_while_rows_join_and_leave(rows, seed, ragged):
    """Prompts draw from few ids so copies find matches; a small MAX_RAGGEDNESS exercises
    realign."""
    saved, batch.MAX_RAGGEDNESS = batch.MAX_RAGGEDNESS, ragged
    try:
        check_rows_against_alone(rows, seed)
    finally:
        batch.MAX_RAGGEDNESS = saved


def check_rows_against_alone(rows, seed):
    rng = random.Random(seed)
    drafters = {
        "draft_model": DraftModel(DRAFT, VOCAB, num_draft=3),
        "self_draft": DraftModel(MODEL, VOCAB, num_draft=5),
    }
    specs, wants = [], []
    for prompt, max_tokens, join, kind in rows:
        want = alone(MODEL, prompt, max_tokens)
        sources = {
            "none": [],
            "prompt_lookup": [PromptLookupSource()],
            "history": [HistoryLookupSource(history=[rng.randrange(16) for _ in range(30)])],
            "oracle": [oracle(want, len(prompt), rng)],
            "noise": [
                ScriptedSource(lambda tokens, k: [rng.randrange(VOCAB) for _ in range(k)], "noise")
            ],
            "draft_model": [PromptLookupSource(), drafters["draft_model"].source()],
            "self_draft": [drafters["self_draft"].source()],
        }[kind]
        specs.append(dict(prompt=prompt, max_tokens=max_tokens, join=join, draft_sources=sources))
        wants.append(want)
    generator = BatchGenerator(MODEL, eos_token_ids=[EOS], drafters=drafters.values())
    got, finish, errors, _ = run(generator, specs)
    for spec, tokens, want, reason, error in zip(specs, got, wants, finish, errors):
        assert error is None
        assert_same_or_near_tie(MODEL, spec["prompt"], tokens, want)
        assert reason == ("stop" if tokens[-1] == EOS else "length")


def test_drafts_are_used_and_accepted_tokens_say_where_they_came_from():
    prompt = [5, 6, 7, 8, 9] * 4
    truth = alone(MODEL, prompt, 30)
    rng = random.Random(0)
    drafter = DraftModel(MODEL, VOCAB)
    specs = [
        dict(
            prompt=prompt,
            max_tokens=30,
            draft_sources=[oracle(truth, len(prompt), rng, corrupt=0.0)],
        ),
        dict(prompt=[1, 2], max_tokens=30, draft_sources=[drafter.source()]),
    ]
    generator = BatchGenerator(MODEL, eos_token_ids=[EOS], drafters=[drafter])
    got, _, _, sources = run(generator, specs)
    assert got[0] == truth and got[1] == alone(MODEL, [1, 2], 30)
    assert "oracle" in sources[0] and TARGET in sources[0] and "draft_model" in sources[1]
    assert generator.stats.row_passes < sum(len(tokens) for tokens in got)
    assert (
        sum(generator.stats.widths.values()) == generator.stats.passes
        and max(generator.stats.widths) > 1
    )


# --- constraints -----------------------------------------------------------------------

TOKENIZER = tiny_byte_tokenizer()
BYTE_VOCAB = len(TOKENIZER)
BYTE_MODEL = tiny_llama(vocab_size=BYTE_VOCAB, num_layers=2, hidden_size=32, seed=7, sharp=3.0)
BYTE_EOS = TOKENIZER.eos_token_id
PATTERNS = [
    r"\d{4}-\d{2}-\d{2}",
    r'\{"name": "[a-z]{1,8}", "age": \d{1,3}\}',
    r"(yes|no|maybe)",
    r"(ab)*c?",
]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
}


def regex_row(pattern, with_forced=True, noise_seed=None):
    if pattern == "schema":
        constraint = RegexConstraint.from_json_schema(SCHEMA, TOKENIZER, BYTE_VOCAB)
    else:
        constraint = RegexConstraint.from_regex(pattern, TOKENIZER, BYTE_VOCAB)
    sources = [ForcedTextSource(constraint)] if with_forced else []
    if noise_seed is not None:
        rng = random.Random(noise_seed)
        sources.append(
            ScriptedSource(lambda tokens, k: [rng.randrange(BYTE_VOCAB) for _ in range(k)], "noise")
        )
    return constraint, sources


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(
        st.tuples(
            st.sampled_from(PATTERNS + ["schema", None]),
            st.booleans(),
            st.lists(st.integers(0, 255), min_size=1, max_size=12),
            st.integers(0, 3),
        ),
        min_size=1,
        max_size=5,
    ),
    seed=st.integers(0, 100),
)
def test_constrained_rows_give_their_own_output_with_forced_text_and_noise(rows, seed):
    specs, wants = [], []
    for index, (pattern, noisy, prompt, join) in enumerate(rows):
        if pattern is None:
            specs.append(dict(prompt=prompt, join=join, max_tokens=24))
            wants.append(alone(BYTE_MODEL, prompt, 24, eos=(BYTE_EOS,)))
            continue
        constraint, sources = regex_row(pattern, noise_seed=seed + index if noisy else None)
        wants.append(alone(BYTE_MODEL, prompt, 48, *regex_row(pattern)[::-1], eos=(BYTE_EOS,)))
        specs.append(
            dict(
                prompt=prompt,
                join=join,
                max_tokens=48,
                draft_sources=sources,
                constraint=constraint,
            )
        )
    got, finish, errors, _ = run(BatchGenerator(BYTE_MODEL, eos_token_ids=[BYTE_EOS]), specs)
    for (pattern, *_), spec, tokens, want, reason in zip(rows, specs, got, wants, finish):
        assert_same_or_near_tie(BYTE_MODEL, spec["prompt"], tokens, want)
        if pattern not in (None, "schema") and reason == "stop":
            assert re.fullmatch(pattern, TOKENIZER.decode(tokens[:-1]), re.ASCII)


def test_grammar_rows_with_forced_text():
    pytest.importorskip("llguidance")
    from constrained.grammar import GrammarConstraint, GrammarForcedSource

    def grammar_row():
        constraint = GrammarConstraint.from_json_schema(SCHEMA, TOKENIZER, BYTE_VOCAB)
        return constraint, [GrammarForcedSource(constraint)]

    prompts = [[1, 2, 3], [40, 41], [7] * 9]
    wants = [alone(BYTE_MODEL, p, 40, *grammar_row()[::-1], eos=(BYTE_EOS,)) for p in prompts]
    specs = []
    for join, prompt in enumerate(prompts):
        constraint, sources = grammar_row()
        specs.append(
            dict(
                prompt=prompt,
                join=join,
                max_tokens=40,
                constraint=constraint,
                draft_sources=sources,
            )
        )
    got, _, errors, sources = run(BatchGenerator(BYTE_MODEL, eos_token_ids=[BYTE_EOS]), specs)
    assert got == wants and errors == [None] * 3
    assert any("grammar" in s for s in sources)


class PoisonedModel:
    """Wraps a model: NaN scores for the tokens in ``columns`` on every call, and for a whole row
    (index ``row`` of the batch) on call number ``at`` of the calls with more than three rows (the
    batch's probe of the model, batch.model_probe.probe, runs up to three)."""

    def __init__(self, model, columns, row=None, at=None):
        self.model, self.layers, self.args = model, model.layers, model.args
        self.columns = mx.array(np.isin(np.arange(model.args.vocab_size), columns))
        self.row, self.at, self.calls = row, at, 0

    def __call__(self, inputs, cache=None):
        logits = self.model(inputs, cache=cache)
        logits = mx.where(self.columns, mx.nan, logits)
        self.calls += inputs.shape[0] > 3
        if self.calls == self.at:
            logits = mx.where(
                (mx.arange(logits.shape[0]) == self.row)[:, None, None], mx.nan, logits
            )
        return logits


def test_a_rows_constraint_holds_under_nan_scores_and_an_all_nan_row_fails_alone():
    # Every token with an odd digit in it scores NaN.
    digits = [i for i in range(BYTE_VOCAB) if set(TOKENIZER.decode([i])) & set("13579")]
    pattern = r"\d{4}-\d{2}-\d{2}"
    prompts = [[1, 2], [5, 6], [9, 8], [7, 7]]  # of one length: prefilled in one call
    wants = [
        alone(PoisonedModel(BYTE_MODEL, digits), p, 20, *regex_row(pattern)[::-1], eos=(BYTE_EOS,))
        for p in prompts
    ]
    for want in wants:
        assert re.fullmatch(r"[02468]{4}-[02468]{2}-[02468]{2}", TOKENIZER.decode(want[:-1]))
    specs = []
    for prompt in prompts:
        constraint, sources = regex_row(pattern)
        specs.append(
            dict(prompt=prompt, max_tokens=20, constraint=constraint, draft_sources=sources)
        )
    # Row 1 scores NaN everywhere on the third call (the prefill is the first).
    got, finish, errors, _ = run(
        BatchGenerator(PoisonedModel(BYTE_MODEL, digits, row=1, at=3), eos_token_ids=[BYTE_EOS]),
        specs,
    )
    assert got[0] == wants[0] and got[2:] == wants[2:]
    assert finish[1] == "error" and "ConstraintError" in errors[1] and "usable score" in errors[1]
    assert wants[1][: len(got[1])] == got[1]


def test_one_rows_error_or_removal_never_touches_another():
    def failing(tokens, k):
        if len(tokens) > 12:
            raise RuntimeError("source broke")
        return [1, 2]

    def failing_processor(tokens, logits):
        if len(tokens) > 6:
            raise RuntimeError("processor broke")
        return logits

    prompts = [[4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 4, 5], [6, 6, 6], [7, 8], [9, 3]]
    drafter = DraftModel(DRAFT, VOCAB)
    specs = [
        dict(prompt=prompts[0], max_tokens=25, draft_sources=[PromptLookupSource()]),
        dict(prompt=prompts[1], max_tokens=25, draft_sources=[ScriptedSource(failing, "failing")]),
        dict(prompt=prompts[2], max_tokens=25, draft_sources=[drafter.source()]),
        dict(prompt=prompts[3], max_tokens=25),
        dict(prompt=prompts[4], max_tokens=25, logits_processors=[[failing_processor]]),
    ]
    generator = BatchGenerator(MODEL, eos_token_ids=[], drafters=[drafter])
    got, finish, errors, _ = run(generator, specs, remove_at={3: 4})
    for i in (0, 2):
        assert got[i] == alone(MODEL, prompts[i], 25, eos=())
    assert finish[1] == "error" and errors[1] == "RuntimeError: source broke"
    assert finish[4] == "error" and errors[4] == "RuntimeError: processor broke"
    assert got[4] == alone(MODEL, prompts[4], 25, eos=())[: len(got[4])]
    assert finish[3] == "removed" and 0 < len(got[3]) < 25
    assert got[3] == alone(MODEL, prompts[3], 25, eos=())[: len(got[3])]


@pytest.mark.parametrize("removed", [[1], [0, 1, 2]])
def test_rows_removed_while_their_prompts_are_prefilled_never_join(removed):
    """With interleaved prefill, long prompts join a chunk per step; removing some (or all) of them
    before they are in leaves the running row and the others' output as alone."""
    rng = random.Random(3)
    running = [5, 6, 7]
    joining = [[rng.randrange(VOCAB) for _ in range(n)] for n in (30, 41, 25)]
    generator = BatchGenerator(
        MODEL, eos_token_ids=[], prefill_step_size=8, interleave_prefill=True
    )
    first = generator.insert([running], max_tokens=30, draft_sources=[[PromptLookupSource()]])[0]
    out = {first: []}
    for response in generator.next():
        out[response.uid] += response.tokens
    uids = generator.insert(joining, max_tokens=12)
    out.update({uid: [] for uid in uids})
    for response in generator.next():  # the joining prompts' first chunk
        out[response.uid] += response.tokens
    assert generator.prefilling is not None
    generator.remove([uids[i] for i in removed])
    while responses := generator.next():
        for response in responses:
            out[response.uid] += response.tokens
    assert out[first] == alone(MODEL, running, 30, eos=())
    for i, (uid, prompt) in enumerate(zip(uids, joining)):
        assert out[uid] == ([] if i in removed else alone(MODEL, prompt, 12, eos=()))
    assert len(generator) == 0


def test_max_batch_keeps_the_other_rows_waiting_their_turn():
    prompts = [[i + 1, i + 2, i + 3] for i in range(5)]
    lengths = [3, 6, 2, 5, 4]
    generator = BatchGenerator(MODEL, eos_token_ids=[], max_batch=2)
    uids = generator.insert(
        prompts, max_tokens=lengths, draft_sources=[[PromptLookupSource()] for _ in prompts]
    )
    out, widest = {uid: [] for uid in uids}, 0
    while responses := generator.next():
        widest = max(widest, len(responses))
        for response in responses:
            out[response.uid] += response.tokens
    assert widest == 2
    assert [out[uid] for uid in uids] == [
        alone(MODEL, p, n, eos=()) for p, n in zip(prompts, lengths)
    ]


def test_a_leaving_row_costs_no_copy_until_half_the_cache_is_unused():
    """A finished row's cache row stays, unused, until half the cache is unused (then one copy drops
    them); the other rows' output and every finished row's own KV entries are as if it ran alone."""
    from mlx_lm.models.cache import make_prompt_cache

    prompts = [[i + 1, i + 2, i + 3, 4] for i in range(4)]
    lengths = [3, 6, 20, 20]
    generator = BatchGenerator(MODEL, eos_token_ids=[], keep_caches=True)
    uids = generator.insert(
        prompts, max_tokens=lengths, draft_sources=[[PromptLookupSource()] for _ in prompts]
    )
    out, caches, shapes = {uid: [] for uid in uids}, {}, []
    while responses := generator.next():
        for response in responses:
            out[response.uid] += response.tokens
            if response.cache is not None:
                caches[response.uid] = response.cache
        if generator.cache is not None:
            shapes.append((generator.cache.rows, len(generator.rows)))
    assert [out[uid] for uid in uids] == [
        alone(MODEL, p, n, eos=()) for p, n in zip(prompts, lengths)
    ]
    # one left: kept; two: compacted
    assert (4, 3) in shapes and (2, 2) in shapes and (4, 2) not in shapes
    for uid, prompt in zip(uids, prompts):
        prefix = caches[uid]
        length = prefix.length
        # all but the last token
        assert length == len(prompt) + len(out[uid]) - 1 and not prefix.states
        single = make_prompt_cache(MODEL)
        MODEL(mx.array([(prompt + out[uid])[:length]]), cache=single)
        for (keys, values, _), layer in zip(prefix.attention, single):
            assert mx.allclose(keys, layer.keys[..., :length, :], atol=1e-4)
            assert mx.allclose(values, layer.values[..., :length, :], atol=1e-4)


def test_waiting_prompts_are_prefilled_in_groups_of_similar_length():
    """The oldest waiting prompt joins with those whose padding stays small; the rest follow, and
    every row still gives its own output."""
    assert prefill_group([100, 40, 98, 240, 105]) == [0, 2, 4]
    assert prefill_group([40, 240, 44]) == [0, 2] and prefill_group([7]) == [0]
    prompts = [[5, 6, 7, 8], [(i * 7) % VOCAB for i in range(40)], [9, 10, 11, 12]]
    generator = BatchGenerator(MODEL, eos_token_ids=[])
    uids = generator.insert(prompts, max_tokens=6)
    out = {uid: [] for uid in uids}
    for response in generator.next():
        out[response.uid] += response.tokens
    assert [row.uid for row in generator.rows] == [uids[0], uids[2]] and generator.waiting[
        0
    ].uid == uids[1]
    while responses := generator.next():
        for response in responses:
            out[response.uid] += response.tokens
    assert [out[uid] for uid in uids] == [alone(MODEL, p, 6, eos=()) for p in prompts]


def test_bad_rows_are_refused_in_one_line():
    generator = BatchGenerator(MODEL)
    shared = PromptLookupSource()
    with pytest.raises(ValueError, match="each row needs its own"):
        generator.insert([[1], [2]], draft_sources=[[shared], [shared]])
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        generator.insert([[1]], max_tokens=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        generator.insert([[1]], sampling=Sampling(top_p=0.0))
    with pytest.raises(ValueError, match="top_k must be an integer >= 0"):
        generator.insert([[1]], sampling=Sampling(top_k=-1))
    with pytest.raises(ValueError, match=r"xtc_threshold must be in \[0, 0.5\]"):
        generator.insert([[1]], sampling=Sampling(xtc_threshold=0.7))
    with pytest.raises(ValueError, match="one list of processors per prompt"):
        generator.insert([[1]], logits_processors=[lambda tokens, logits: logits])
    with pytest.raises(ValueError, match="one value or one per prompt"):
        generator.insert([[1], [2]], sampling=[Sampling()])
    with pytest.raises(ValueError, match="prompt is empty"):
        generator.insert([[]])
    with pytest.raises(ValueError, match="one list of sources per prompt"):
        generator.insert([[1]], draft_sources=[PromptLookupSource()])
    assert len(generator) == 0


def test_batch_generate_decodes_text_prompts():
    prompts = ["ab", "hello there", [1, 2, 3]]
    result = batch_generate(
        BYTE_MODEL,
        TOKENIZER,
        prompts,
        max_tokens=[5, 9, 7],
        draft_sources=[[PromptLookupSource()] for _ in prompts],
    )
    for prompt, tokens, text in zip(prompts, result.tokens, result.texts):
        ids = TOKENIZER.encode(prompt) if isinstance(prompt, str) else prompt
        want = alone(BYTE_MODEL, ids, len(tokens), eos=(BYTE_EOS,))
        assert tokens == want and text == TOKENIZER.decode([t for t in want if t != BYTE_EOS])
    assert result.to_json()["width_histogram"] and result.finish_reasons[0] in ("stop", "length")


# --- sampling --------------------------------------------------------------------------

SMALL = tiny_llama(vocab_size=8, num_layers=2, seed=3, sharp=2.0)
SMALL_DRAFT = tiny_llama(vocab_size=8, num_layers=1, seed=9, sharp=2.0)


@pytest.mark.parametrize("drafting", ["scripted", "draft_model"])
def test_sampling_keeps_each_rows_distribution(drafting):
    """Two tokens sampled by 1500 rows, 100 at a time, with greedy rows among them, chi-squared
    against the target's own joint distribution; the greedy rows give their greedy output."""
    sampling, vocab, prompt = Sampling(temp=1.0, top_p=0.9), 8, [1, 2, 3]
    p1 = np.array(sampling.probs(SMALL(mx.array([prompt]))[0, -1:])[0])
    p2 = np.array(sampling.probs(SMALL(mx.array([prompt + [t] for t in range(vocab)]))[:, -1]))
    joint = (p1[:, None] * p2).reshape(-1)
    greedy = alone(SMALL, [4, 5], 6, eos=())
    q = np.full(vocab, 1 / vocab, np.float32)
    rng = np.random.default_rng(0)
    mx.random.seed(3)
    counts = np.zeros(vocab * vocab, np.int64)
    proposed = accepted = 0
    for _ in range(15):
        drafter = DraftModel(SMALL_DRAFT, vocab, num_draft=2, adaptive=False, min_confidence=0.0)

        def sources():
            if drafting == "draft_model":
                return [drafter.source()]
            return [
                ScriptedSource(
                    lambda tokens, k: rng.choice(vocab, size=min(k, 2), p=q).tolist(),
                    "random",
                    probs_fn=lambda tokens, draft: mx.array(np.tile(q, (len(draft), 1))),
                )
            ]

        generator = BatchGenerator(SMALL, max_width=3, prefill_batch_size=128, drafters=[drafter])
        uids = generator.insert(
            [prompt] * 100,
            sampling=sampling,
            max_tokens=2,
            draft_sources=[sources() for _ in range(100)],
        )
        greedy_uids = generator.insert(
            [[4, 5]] * 2, max_tokens=6, draft_sources=[sources() for _ in range(2)]
        )
        out = {uid: [] for uid in uids + greedy_uids}
        while responses := generator.next():
            for response in responses:
                out[response.uid] += response.tokens
                if response.stats is not None:
                    proposed += response.stats.draft_proposed
                    accepted += response.stats.draft_accepted
        for uid in uids:
            counts[out[uid][0] * vocab + out[uid][1]] += 1
        assert [out[uid] for uid in greedy_uids] == [greedy, greedy]
    assert chi_square_p_value(counts, joint) > 1e-3
    assert 0 < accepted < proposed


# --- the width policy ------------------------------------------------------------------


def test_choose_width_weighs_expected_tokens_against_the_pass_cost():
    cheap, dear = PassCost(default_token_cost=0.01), PassCost(default_token_cost=1.0)
    assert choose_width([8, 8], [0.9, 0.9], cheap) == 9
    assert choose_width([8, 8], [0.9, 0.9], dear) == 1
    assert choose_width([0, 0], [0.9, 0.9], cheap) == 1
    assert choose_width([8, 8], [0.9, 0.9], cheap, max_width=4) == 4
    # One sure long draft among rows without drafts: worth a wide pass only when width is cheap.
    assert choose_width([6, 0, 0, 0], [1.0, 0, 0, 0], PassCost(default_token_cost=0.05)) == 7
    assert choose_width([6, 0, 0, 0], [1.0, 0, 0, 0], PassCost(default_token_cost=0.5)) == 1


def test_the_gate_asks_while_drafting_pays_and_probes_now_and_then():
    gate = DraftGate()
    assert gate.ask()
    gate.record(1)  # the step drafted nothing
    asked = []
    for _ in range(8 * Backoff.MAX_GAP):
        asked.append(gate.ask())
        if asked[-1]:
            gate.record(1)
    probes = [i for i, a in enumerate(asked) if a]
    skips = [later - earlier - 1 for earlier, later in zip([-1] + probes, probes)]
    assert skips == [min(2**i, Backoff.MAX_GAP) for i in range(len(skips))]  # 1, 2, 4 ... the cap
    assert skips.count(Backoff.MAX_GAP) >= 3
    gate.record(3)  # a probe that drafted
    assert all(gate.ask() for _ in range(5))
    gate.record(1)
    gate.reset()  # rows joined
    assert gate.ask()


def test_free_sources_draft_on_the_steps_the_gate_skips():
    """Forced text costs nothing to ask for, so a constrained row drafts it also on a step on which
    the gate spares the sources that cost something (here one that counts its calls)."""
    calls = []
    costly = ScriptedSource(lambda tokens, k: calls.append(len(tokens)) or [], name="costly")
    constraint = RegexConstraint.from_regex("x{30}", TOKENIZER, BYTE_VOCAB)
    generator = BatchGenerator(
        BYTE_MODEL, pass_cost=PassCost(default_token_cost=1e-3, clock=lambda: 0.0)
    )
    generator.insert(
        [[10, 20]],
        constraint=[constraint],
        max_tokens=30,
        draft_sources=[[costly, ForcedTextSource(constraint)]],
    )
    generator.next()  # admits the row and asks both sources
    assert len(calls) == 1
    generator.gate.record(1)  # as after a step that drafted nothing: the gate skips the next one
    (response,) = generator.next()
    assert len(calls) == 1
    assert response.sources[0] == "regex" and len(response.tokens) > 1


def test_the_gate_knows_every_forced_text_source_as_free():
    """The batch tells the forced text's sources by name: each of constrained/'s is in the set."""
    from constrained.grammar import GrammarForcedSource
    from constrained.thinking import ThinkingForcedSource

    for source in (ForcedTextSource, GrammarForcedSource, ThinkingForcedSource):
        assert source.name in DraftGate().free


class ClockedModel:
    """A model whose every pass takes ``base + per_token * (width - 1)`` simulated seconds."""

    def __init__(self, model, base, per_token):
        self.model, self.layers, self.args = model, model.layers, model.args
        self.base, self.per_token, self.now = base, per_token, 0.0

    def clock(self):
        return self.now

    def __call__(self, inputs, cache=None):
        self.now += self.base + self.per_token * (inputs.shape[1] - 1)
        return self.model(inputs, cache=cache)


def test_the_policy_drafts_wider_where_verifying_is_cheap_with_identical_output():
    prompts = [[5, 6, 7, 8, 9, 10] * 3 + [i] for i in range(4)] + [[11, 12, 13, 14] * 4]
    wants = [alone(MODEL, p, 40, eos=()) for p in prompts]
    results = {}
    for name, per_token in (("cheap", 0.001), ("dear", 2.0)):
        model = ClockedModel(MODEL, 1.0, per_token)
        generator = BatchGenerator(model, pass_cost=PassCost(clock=model.clock))
        generator.insert(
            prompts, max_tokens=40, draft_sources=[[PromptLookupSource()] for _ in prompts]
        )
        out = {}
        while responses := generator.next():
            for response in responses:
                out.setdefault(response.uid, []).extend(response.tokens)
        assert list(out.values()) == wants
        widths = generator.stats.widths
        results[name] = (
            sum(w * n for w, n in widths.items()) / sum(widths.values()),
            generator.stats.passes / generator.stats.generation_tokens,
            widths,
        )
    assert results["cheap"][0] > results["dear"][0] + 1, results
    assert results["cheap"][1] < results["dear"][1], results
    # mostly no drafts where dear
    assert results["dear"][2][1] > results["dear"][2].total() / 2, results


def test_sources_whose_drafts_never_pay_are_not_asked_and_output_stays_the_same():
    prompts = [[i, i + 1, i + 2] for i in range(6)]
    wants = [alone(MODEL, p, 40, eos=()) for p in prompts]
    model = ClockedModel(MODEL, 1.0, 0.5)
    asked = [0]

    def wrong(tokens, k):
        asked[0] += 1
        return [(tokens[-1] + 7) % VOCAB] * k

    sources = [ScriptedSource(wrong, "wrong") for _ in prompts]
    generator = BatchGenerator(model, pass_cost=PassCost(clock=model.clock))
    uids = generator.insert(prompts, max_tokens=40, draft_sources=[[s] for s in sources])
    out = {uid: [] for uid in uids}
    while responses := generator.next():
        for response in responses:
            out[response.uid] += response.tokens
    assert [out[uid] for uid in uids] == wants
    assert generator.stats.passes == 40 and asked[0] / len(prompts) < 12


def test_embedded_model_rows_match_their_single_sequence_output(embedded, chat_prompt):
    """The real model in float32: a batched matmul may sum in another order than a single row's,
    so a flipped token must be a near-tie (assert_same_or_near_tie)."""
    model, tokenizer, _ = embedded
    texts = [
        "What is the capital of France?",
        "Repeat after me: the quick brown fox jumps over the lazy dog.",
        "Write a haiku about rain.",
        "List three prime numbers.",
    ]
    prompts = [chat_prompt(text) for text in texts]
    eos = sorted(tokenizer.eos_token_ids)
    specs = [
        dict(prompt=p, max_tokens=16, join=i // 2, draft_sources=[PromptLookupSource()])
        for i, p in enumerate(prompts)
    ]
    got, _, errors, _ = run(BatchGenerator(model, eos_token_ids=eos), specs)
    for prompt, tokens in zip(prompts, got):
        assert_same_or_near_tie(model, prompt, tokens, alone(model, prompt, 16, eos=eos))
    assert errors == [None] * 4


# --- logprobs --------------------------------------------------------------------------


def full_sequence_logprobs(model, prompt, tokens, constraint=None):
    """The oracle: a plain log_softmax of the model's logits over the whole sequence in one pass
    (masked by the constraint's masks along ``tokens`` when there is one)."""
    logits = model(mx.array([prompt + tokens]))[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    if constraint is not None:
        constraint.reset()
        logits = mx.where(constraint.masks(constraint.walk(tokens))[: len(tokens)], logits, -mx.inf)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def logprobs_run(model, prompt, max_tokens, sources=(), top=5, constraint=None, eos=EOS):
    """One row that asks for logprobs, beside one that does not; the first row's tokens,
    TokenLogprobs and sources."""
    generator = BatchGenerator(model, eos_token_ids=[eos])
    (uid,) = generator.insert(
        [prompt],
        draft_sources=[list(sources)],
        constraint=[constraint],
        max_tokens=max_tokens,
        logprobs=top,
    )
    generator.insert([[1, 2, 3]], max_tokens=max_tokens)
    tokens, entries, origins = [], [], []
    while responses := generator.next():
        for response in responses:
            if response.uid != uid:
                assert response.logprobs is None  # nothing computed for a row that did not ask
                continue
            assert response.logprobs is not None and len(response.logprobs) == len(response.tokens)
            tokens, entries, origins = (
                tokens + response.tokens,
                entries + response.logprobs,
                origins + response.sources,
            )
    return tokens, entries, origins


def test_logprobs_are_the_targets_whether_a_token_was_drafted_or_not():
    prompt = [5, 6, 7, 8, 9] * 4
    truth = alone(MODEL, prompt, 30)
    runs = {
        "plain": logprobs_run(MODEL, prompt, 30),
        "prompt_lookup": logprobs_run(MODEL, prompt, 30, [PromptLookupSource()]),
        "oracle": logprobs_run(MODEL, prompt, 30, [oracle(truth, len(prompt), random.Random(0))]),
    }
    # drafted and target tokens both
    assert "oracle" in runs["oracle"][2] and TARGET in runs["oracle"][2]
    want = full_sequence_logprobs(MODEL, prompt, truth)
    for name, (tokens, entries, _) in runs.items():
        assert tokens == truth, name
        for position, (token, entry) in enumerate(zip(tokens, entries)):
            row = want[position]
            assert abs(entry.logprob - row[token]) < 1e-5, (name, position)
            # greedy: the top
            assert entry.top_ids == np.argsort(-row)[:5].tolist() and entry.top_ids[0] == token
            assert np.allclose(entry.top_logprobs, row[entry.top_ids], atol=1e-5)
            assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)
    for name in ("prompt_lookup", "oracle"):
        got = np.array([[e.logprob] + e.top_logprobs for e in runs[name][1]])
        assert (
            np.abs(got - np.array([[e.logprob] + e.top_logprobs for e in runs["plain"][1]])).max()
            < 1e-5
        )
    assert [e.top_ids for e in logprobs_run(MODEL, prompt, 4, top=0)[1]] == [[]] * 4
    with pytest.raises(ValueError, match="logprobs must be None or >= 0"):
        BatchGenerator(MODEL).insert([[1]], logprobs=-1)


def test_logprobs_under_a_constraint_are_of_the_masked_distribution():
    pattern = PATTERNS[1]
    constraint, sources = regex_row(pattern)
    tokens, entries, origins = logprobs_run(
        BYTE_MODEL, [10, 20, 30], 48, sources, top=3, constraint=constraint, eos=BYTE_EOS
    )
    assert tokens[-1] == BYTE_EOS and re.fullmatch(pattern, TOKENIZER.decode(tokens[:-1]))
    assert "regex" in origins and TARGET in origins  # the forced text was drafted
    want = full_sequence_logprobs(
        BYTE_MODEL, [10, 20, 30], tokens, RegexConstraint(constraint.index)
    )
    for position, (token, entry) in enumerate(zip(tokens, entries)):
        assert abs(entry.logprob - want[position][token]) < 1e-5
        finite = [value for value in entry.top_logprobs if value > -np.inf]
        assert np.allclose(finite, want[position][entry.top_ids[: len(finite)]], atol=1e-5)
    assert abs(entries[-1].logprob) < 1e-6  # only EOS is allowed after the '}': probability 1


@pytest.mark.parametrize("name", ["qwen3_next", "gemma3_text"])
def test_a_finished_rows_cache_serves_the_next_turn_of_a_hybrid_or_sliding_model(name):
    """A row's CachedPrefix (attention entries and, for recurrent layers, their states after exactly
    its tokens) makes the next turn prefill only what is new, and give what a fresh start gives; a
    prefix with states cannot be cut shorter."""
    from tests.architectures import build

    model, _ = build(name)
    first = [3, 14, 15, 92, 65, 35, 89, 79]
    generator = BatchGenerator(model, keep_caches=True)
    (uid,) = generator.insert([first], max_tokens=12)
    out, prefix = [], None
    while responses := generator.next():
        for response in responses:
            out += response.tokens
            prefix = response.cache if response.cache is not None else prefix
    assert prefix.length == len(first) + len(out) - 1
    assert (prefix.usable(prefix.length - 2) == 0) == (name == "qwen3_next")
    second = first + out + [26, 53, 58]
    want = alone(model, second, 12, eos=())
    shapes = []

    class Recorded:  # the model, noting the shape of every call
        layers, args, make_cache = model.layers, model.args, model.make_cache

        def __call__(self, inputs, cache=None):
            shapes.append(inputs.shape)
            return model(inputs, cache=cache)

    for cached in ([prefix], [prefix, None]):
        generator, shapes[:] = BatchGenerator(Recorded()), []
        uids = generator.insert([second] * len(cached), max_tokens=12, prompt_cache=cached)
        got = {uid: [] for uid in uids}
        while responses := generator.next():
            for response in responses:
                got[response.uid] += response.tokens
        assert [got[uid] for uid in uids] == [want] * len(cached)
        # the widest call: the prefill
        prefill = max(width for rows, width in shapes if rows == len(cached))
        assert prefill == len(second) - 1 - (prefix.length if len(cached) == 1 else 0)


@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss", "baichuan_m1"])
def test_sliding_rows_drop_old_slots_and_stay_lossless_while_rows_join_and_leave(name, monkeypatch):
    """Sliding layers keep each row's window and a little slack (dropping every few tokens here),
    through rows joining, leaving, realigning and drafting across drops; each row gives mlx-lm's
    tokens. A finished row's prefix (its sliding layers' dropped positions recorded) serves the
    next turn, and only prompts long enough for its windows."""
    from decoder.cache import KVRows
    from tests.architecture_checks import mlx_lm_greedy
    from tests.architectures import build

    monkeypatch.setattr(KVRows, "window_step", 4)
    monkeypatch.setattr(KVRows, "max_rollback", 5)
    monkeypatch.setattr(batch, "MAX_RAGGEDNESS", 3)
    model, _ = build(name)
    prompts = [
        [(7 * i + 3 * r) % 50 + 4 for i in range(length)]
        for r, length in enumerate([30, 5, 19, 41])
    ]
    wants = [mlx_lm_greedy(model, prompt, 30) for prompt in prompts]
    specs = [
        dict(
            prompt=prompt,
            max_tokens=30,
            join=join,
            draft_sources=[oracle(want, len(prompt), random.Random(r))],
        )
        for r, (prompt, want, join) in enumerate(zip(prompts, wants, [0, 0, 4, 9]))
    ]
    got, _, errors, _ = run(BatchGenerator(model, keep_caches=True), specs, remove_at={1: 12})
    assert errors[0] is None and got[0] == wants[0] and got[2] == wants[2] and got[3] == wants[3]
    assert got[1] == wants[1][: len(got[1])]

    generator = BatchGenerator(model, keep_caches=True)
    generator.insert([prompts[3]], max_tokens=30)
    prefix = None
    while responses := generator.next():
        prefix = next((r.cache for r in responses if r.cache is not None), prefix)
    assert any(first > 0 for _, _, first in prefix.attention)  # a sliding layer dropped positions
    assert prefix.usable(5) == 0 and prefix.usable(prefix.length) == prefix.length
    second = prompts[3] + wants[3] + [9, 8, 7]
    generator = BatchGenerator(model)
    (uid,) = generator.insert([second], max_tokens=12, prompt_cache=[prefix])
    out = [t for responses in iter(generator.next, []) for r in responses for t in r.tokens]
    assert out == mlx_lm_greedy(model, second, 12)


@pytest.mark.parametrize("name", ["llama", "qwen3_next", "gemma3_text"])
def test_rows_with_one_prompt_share_one_prefill(name):
    """Rows that join with the same prompt (a request's n choices) run it through the model once,
    its cache copied to each row; every row still gives what it gives alone, and a different prompt
    or cached prefix length beside them is prefilled on its own."""
    from tests.architectures import build

    model = MODEL if name == "llama" else build(name)[0]
    prompt, other = [5, 17, 9, 33, 8, 21, 40, 6, 11], [7, 30, 12, 4]
    want = alone(model, prompt, 10, eos=())
    shapes = []

    class Recorded:  # the model, noting the shape of every call
        layers, args = model.layers, model.args
        make_cache = getattr(model, "make_cache", None)

        def __call__(self, inputs, cache=None):
            shapes.append(inputs.shape)
            return model(inputs, cache=cache)

    generator = BatchGenerator(Recorded() if name != "llama" else model)
    uids = generator.insert([prompt, prompt, other, prompt], max_tokens=10, eos_token_ids=())
    got = {uid: [] for uid in uids}
    while responses := generator.next():
        for response in responses:
            got[response.uid] += response.tokens
    assert [got[uid] for uid in uids[:2] + uids[3:]] == [want] * 3
    assert got[uids[2]] == alone(model, other, 10, eos=())
    assert generator.stats.prefilled_tokens == len(prompt) - 1 + len(other) - 1
    assert generator.stats.prompt_tokens == 3 * len(prompt) + len(other)
    if shapes:  # the three rows' prompt: one call of one row (the other joins apart, shorter)
        assert [rows for rows, width in shapes if width == len(prompt) - 1] == [1]


def test_choose_width_reads_a_trees_chances_of_its_nodes():
    """A tree's acceptance is its nodes' chances in the order a narrower pass keeps them: a sure
    first node and worthless others make 2 the best width, where a chain's rate would say more."""
    cost = PassCost(default_token_cost=0.05)
    assert choose_width([6, 0], [[1.0, 0.0, 0.0, 0.0, 0.0, 0.0], 0.0], cost) == 2
    assert choose_width([6, 0], [1.0, 0.0], cost) == 7
