"""Draft heads and MTP layers per row in a batch: each row reads its own hidden states from the
target's cache (``hidden_states.FeatureRows``) while rows of different lengths join and leave,
under a regex, with a prompt cache, and sampling keeps each row's distribution."""

import random

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch import BatchGenerator
from constrained import RegexConstraint
from decoder import Sampling, generate_step, make_cache
from decoder.hidden_states import output_rows
from decoder.pass_cost import PassCost
from draft_head.head import DraftHead, head_args
from draft_head.source import HeadDrafter
from loading.target import load_mlx_lm
from mtp.source import MTPDrafter
from prompt_lookup import PromptLookupSource
from tests.helpers import chi_square_p_value, drain, tiny_byte_tokenizer, tiny_llama
from tests.mtp_fixtures import VOCAB, write_checkpoint
from tests.test_batch import alone, assert_same_or_near_tie, run
from tests.test_draft_trees import Clocked


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3_next"])
def mtp_model(request, tmp_path_factory):
    """``(directory, target)``: an MTP layer that is right often, not always; qwen3_next is
    hybrid."""
    path = tmp_path_factory.mktemp(request.param)
    write_checkpoint(
        path, request.param, seed=1, exact=True, noise=0.08, tokenizer=tiny_byte_tokenizer()
    )
    return path, load_mlx_lm(path)[0]


def check_rows(target, tap, drafter, rows, remove_at=None):
    """Every row of ``rows`` (prompt, max_tokens, join, with_lookup) gives its greedy output
    alone."""
    specs = [
        dict(
            prompt=prompt,
            max_tokens=max_tokens,
            join=join,
            draft_sources=([PromptLookupSource()] if lookup else []) + [drafter.source()],
        )
        for prompt, max_tokens, join, lookup in rows
    ]
    # on a simulated clock, so that how wide the policy drafts, and so how many drafts are
    # accepted, does not depend on this machine's timings (under load it once drafted fewer)
    model = Clocked(tap, per_token=0.05)
    generator = BatchGenerator(
        model, eos_token_ids=(), drafters=[drafter], pass_cost=PassCost(clock=model.clock)
    )
    out, finish, errors, sources = run(generator, specs, remove_at)
    for index, (prompt, max_tokens, _, _) in enumerate(rows):
        assert errors[index] is None
        if finish[index] != "removed":
            assert_same_or_near_tie(
                target, prompt, out[index], alone(target, prompt, max_tokens, eos=())
            )
    return sources


def test_mtp_rows_give_their_own_output_while_rows_join_and_leave(mtp_model):
    path, target = mtp_model
    tap, drafter = MTPDrafter.create(target, path, num_draft=3, adaptive=False)
    rows = [
        ([5, 6, 7, 8], 30, 0, False),
        ([1], 25, 0, True),
        (list(range(2, 32, 2)), 30, 2, False),
        ([9, 9, 9, 9, 9, 9], 20, 5, True),
        ([4, 4], 30, 1, False),
    ]
    sources = check_rows(target, tap, drafter, rows, remove_at={4: 6})
    assert sum(row.count("mtp") for row in sources) > 20  # the rows' MTP drafts were accepted
    assert len(drafter.rows) == 0  # every row left the drafter with its batch row


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    rows=st.lists(
        st.tuples(
            st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
            st.integers(1, 20),
            st.integers(0, 4),
            st.booleans(),
        ),
        min_size=1,
        max_size=4,
    ),
    num_draft=st.integers(1, 4),
)
def test_mtp_rows_are_lossless_for_any_prompts_and_joins(mtp_model, rows, num_draft):
    path, target = mtp_model
    tap, drafter = MTPDrafter.create(target, path, num_draft=num_draft, adaptive=False)
    check_rows(target, tap, drafter, rows)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_next"])
def test_mtp_rows_under_a_regex_give_the_constrained_output(tmp_path, model_type):
    tokenizer = tiny_byte_tokenizer()
    vocab = len(tokenizer.get_vocab())
    write_checkpoint(tmp_path, model_type, seed=3, vocab_size=vocab, tokenizer=tokenizer)
    target, _, _ = load_mlx_lm(tmp_path)
    tap, drafter = MTPDrafter.create(target, tmp_path, num_draft=3, adaptive=False)
    patterns = [r"(ab|12)+-[0-9]{2,5}", r"[a-c]{3,9}", r"x(yz)*"]

    def constraint(pattern):
        return RegexConstraint.from_regex(pattern, tokenizer, vocab_size=vocab)

    specs = [
        dict(
            prompt=[1 + i, 2, 3],
            join=i,
            max_tokens=12,
            draft_sources=[drafter.source()],
            constraint=constraint(pattern),
        )
        for i, pattern in enumerate(patterns)
    ]
    out, _, errors, _ = run(BatchGenerator(tap, eos_token_ids=(), drafters=[drafter]), specs)
    for spec, pattern, tokens in zip(specs, patterns, out):
        assert tokens == alone(target, spec["prompt"], 12, constraint=constraint(pattern), eos=())
    assert errors == [None] * 3


def test_a_finished_mtp_rows_cache_keeps_its_hidden_states_for_the_next_turn(mtp_model):
    path, target = mtp_model
    tap, drafter = MTPDrafter.create(target, path, num_draft=3, adaptive=False)
    # on a simulated clock: whether the width policy verifies drafts does not depend on this
    # machine's timings (under load it once verified none)
    model = Clocked(tap, per_token=0.05)
    generator = BatchGenerator(
        model,
        eos_token_ids=(),
        keep_caches=True,
        drafters=[drafter],
        pass_cost=PassCost(clock=model.clock),
    )
    first = [5, 6, 7, 8, 9]
    generator.insert([first], max_tokens=10, draft_sources=[[drafter.source()]])
    tokens, prefix = [], None
    while responses := generator.next():
        for response in responses:
            tokens += response.tokens
            prefix = response.cache or prefix
    assert prefix.extra[0] is not None and prefix.extra[0][0].shape[2] == prefix.length
    second = first + tokens + [3, 4]
    generator.insert(
        [second], max_tokens=16, draft_sources=[[drafter.source()]], prompt_cache=[prefix]
    )
    out, drafted = [], []
    while responses := generator.next():
        for response in responses:
            out += response.tokens
            drafted += response.sources
    assert_same_or_near_tie(target, second, out, alone(target, second, 16, eos=()))
    assert "mtp" in drafted


def test_head_rows_give_their_own_output_while_rows_join_and_leave():
    target = tiny_llama(vocab_size=64, num_layers=3, seed=0)
    mx.random.seed(5)
    vocab_ids = mx.arange(0, 64, 2)
    head = DraftHead(head_args(target.args), output_rows(target, vocab_ids))
    tap, drafter = HeadDrafter.around(target, head, vocab_ids, num_draft=3, adaptive=False)
    rng = random.Random(0)
    rows = [
        ([rng.randrange(64) for _ in range(n)], 20, join, join % 2 == 1)
        for n, join in ((3, 0), (17, 0), (1, 1), (30, 3))
    ]
    check_rows(target, tap, drafter, rows, remove_at={1: 4})


def test_sampling_with_mtp_rows_keeps_each_rows_distribution(tmp_path):
    """Two tokens sampled by 1200 rows, 100 at a time, chi-squared against the target's joint
    distribution."""
    write_checkpoint(tmp_path, "deepseek_v3", seed=4, vocab_size=8, tokenizer=tiny_byte_tokenizer())
    target, _, _ = load_mlx_lm(tmp_path)
    sampling, vocab, prompt = Sampling(temp=1.0, top_p=0.9), 8, [1, 2, 3]
    p1 = np.array(sampling.probs(target(mx.array([prompt]))[0, -1:])[0])
    p2 = np.array(sampling.probs(target(mx.array([prompt + [t] for t in range(vocab)]))[:, -1]))
    joint = (p1[:, None] * p2).reshape(-1)
    mx.random.seed(3)
    counts, proposed, accepted = np.zeros(vocab * vocab, np.int64), 0, 0
    for _ in range(12):
        tap, drafter = MTPDrafter.create(target, tmp_path, num_draft=2, adaptive=False)
        generator = BatchGenerator(tap, max_width=3, prefill_batch_size=128, drafters=[drafter])
        uids = generator.insert(
            [prompt] * 100,
            sampling=sampling,
            max_tokens=2,
            draft_sources=[[drafter.source()] for _ in range(100)],
        )
        out = {uid: [] for uid in uids}
        while responses := generator.next():
            for response in responses:
                out[response.uid] += response.tokens
                if response.stats is not None:
                    proposed += response.stats.draft_proposed
                    accepted += response.stats.draft_accepted
        for uid in uids:
            counts[out[uid][0] * vocab + out[uid][1]] += 1
    assert chi_square_p_value(counts, joint) > 1e-3
    assert 0 < accepted < proposed


def random_head_drafter(target, seed=5):
    mx.random.seed(seed)
    vocab_ids = mx.arange(0, target.args.vocab_size)
    head = DraftHead(head_args(target.args), output_rows(target, vocab_ids))
    mx.eval(head.parameters())
    return HeadDrafter.around(target, head, vocab_ids, num_draft=3, adaptive=False)


def first_drafts(tap, source, prompt, prompt_cache=None, steps=3) -> list:
    """The first ``steps`` drafts ``source`` proposes in the one-row loop."""
    drafts, propose = [], source.propose

    def spy(tokens, max_draft, max_nodes=None):
        draft = propose(tokens, max_draft, max_nodes)
        drafts.append(None if draft is None else draft.tokens)
        return draft

    source.propose = spy
    for _ in generate_step(
        prompt,
        tap,
        eos_token_ids=(),
        draft_sources=[source],
        max_tokens=12,
        prompt_cache=prompt_cache,
    ):
        pass
    return drafts[:steps]


def test_a_heads_first_draft_after_a_prompt_cache_hit_reads_that_caches_features():
    """#59: a prompt cache holding all but the last prompt token leaves nothing to prefill, and
    the head read the hidden states of the target's last call, made on another cache."""
    target = tiny_llama(vocab_size=64, num_layers=3, seed=0)
    tap, drafter = random_head_drafter(target)
    prompt, cache = [5, 9, 3, 17, 22, 8, 40, 2, 11], make_cache(tap)
    first_drafts(tap, drafter.source(), prompt, cache)
    first_drafts(tap, drafter.source(), list(range(1, 26)), make_cache(tap))  # another cache
    # the cache holds the text but its last token: the next prompt's first cache.held() tokens
    text = prompt + [t for t, _ in generate_step(prompt, target, eos_token_ids=(), max_tokens=12)]
    follow = text[: cache.held()] + [7]
    warm = first_drafts(tap, drafter.source(), follow, cache)
    assert warm == first_drafts(tap, drafter.source(), follow)


def test_a_rows_drafter_not_handed_to_the_batch_is_adopted():
    """#59: a source whose drafter the batch was not given drafted for its row alone, evicting
    the other rows' drafter caches at every step; the batch now adopts it."""
    target = tiny_llama(vocab_size=64, num_layers=3, seed=0)
    tap, drafter = random_head_drafter(target)
    calls, draft_all = [], drafter.draft_all
    drafter.draft_all = lambda requests, *args: (
        calls.append(len(requests)) or draft_all(requests, *args)
    )
    generator = BatchGenerator(tap, eos_token_ids=())
    prompts = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]
    uids = generator.insert(
        prompts, max_tokens=10, draft_sources=[[drafter.source()] for _ in prompts]
    )
    out = drain(generator, uids)
    assert generator.drafters == [drafter] and max(calls) == 3
    for prompt, tokens in zip(prompts, out):
        assert_same_or_near_tie(target, prompt, tokens, alone(target, prompt, 10, eos=()))


def test_closing_a_generator_releases_its_drafters_rows():
    """#59: the server replaces a generator whose step failed; its drafters' rows must go."""
    target = tiny_llama(vocab_size=64, num_layers=3, seed=0)
    tap, drafter = random_head_drafter(target)
    generator = BatchGenerator(tap, eos_token_ids=(), drafters=[drafter])
    generator.insert(
        [[3, 4, 5, 6], [7, 8, 9]],
        max_tokens=10,
        draft_sources=[[drafter.source()], [drafter.source()]],
    )
    generator.next()
    generator.next()
    assert len(drafter.rows) == 2
    generator.close()
    assert drafter.rows == [] and drafter.cache is None and len(generator) == 0
