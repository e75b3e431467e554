"""Draft trees (decoder/tree.py): the tree pass equals chain passes, the compaction leaves the cache
a chain would have, greedy decoding with random trees equals plain decoding (one row and a
batch), and SpecInfer's rule keeps the target's distribution (with a control the check rejects).
Every attention architecture: tests/test_architectures.py."""

import random
from collections import defaultdict

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import decoder.accept as accept
import decoder.loop as loop
import decoder.tree as tree
from batch import BatchGenerator
from decoder import Sampling, enable_trees, generate_step
from decoder.accept import accept_tree
from decoder.cache import make_cache
from decoder.draft import Draft, DraftSource
from decoder.tree import kept_slots, layout, path_to
from decoder.tree_choice import TreeChoice
from prompt_lookup import PromptLookupSource
from prompt_lookup.trie import choose, judge
from tests.architectures import build
from tests.helpers import chi_square_p_value, count_trees, drain, tiny_byte_tokenizer, tiny_llama


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def model(request):
    """Full attention, and sliding windows of 8 beside it."""
    model = build(request.param)[0]
    enable_trees(model)
    return model


def plain(model, prompt: list, max_tokens: int) -> list:
    return [t for t, _ in generate_step(prompt, model, eos_token_ids=(), max_tokens=max_tokens)]


class RandomTrees(DraftSource):
    """Random trees in which the true continuation (``truth``, the plain greedy text) hides
    under any child, at any depth, beside wrong tokens."""

    name = "random_trees"

    def __init__(self, prompt_length: int, truth: list, seed: int):
        self.prompt_length, self.truth, self.random = prompt_length, truth, random.Random(seed)

    def propose(self, tokens, max_draft, max_nodes=None):
        if max_nodes is None:
            return None
        done = len(tokens) - self.prompt_length  # tokens of the truth emitted so far
        tokens_out, parents, right = [], [], []
        for node in range(self.random.randint(1, max_nodes)):
            parent = self.random.randint(-1, node - 1)
            if tree.depths(parents + [parent])[-1] > max_draft:
                parent = -1
            depth = tree.depths(parents + [parent])[-1]
            on_truth = parent < 0 or right[parent]
            wanted = self.truth[done + depth - 1] if done + depth - 1 < len(self.truth) else 0
            correct = on_truth and self.random.random() < 0.5
            token = wanted if correct else self.random.randrange(64)
            tokens_out.append(token)
            parents.append(parent)
            right.append(on_truth and token == wanted)
        return Draft(tokens_out, parents=parents)


def test_layout_lets_each_node_see_its_ancestors_only():
    depth, visible = layout(2, [-1, -1, 1], 6)
    assert depth == [0, 1, 2, 2, 3, 5]
    assert visible[3] == [True, True, False, True, False, False]  # node 1: pending and itself
    assert visible[4] == [True, True, False, True, True, False]  # node 2: under node 1
    assert visible[5] == [True] * 6  # padding sees what comes before it
    assert kept_slots(2, [1, 2]) == [0, 1, 3, 4]


def test_greedy_follows_the_child_equal_to_the_argmax():
    logits = mx.full((5, 8), -1.0)
    # root -> 3; node 1 (token 3) -> 5; node 3 (token 5 under node 1) -> 7
    logits = logits.at[0, 3].add(2).at[2, 5].add(2).at[4, 7].add(2)
    draft = Draft([4, 3, 6, 5], parents=[-1, -1, 1, 1])
    assert accept_tree(logits, draft, Sampling()) == ([1, 3], 7)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10**6), length=st.integers(3, 20))
def test_random_trees_give_plain_greedy_tokens(model, seed, length):
    prompt = mx.random.randint(0, 64, (length,), key=mx.random.key(seed)).tolist()
    want = plain(model, prompt, 24)
    source = RandomTrees(len(prompt), want, seed)
    got = [
        t
        for t, _ in generate_step(
            prompt, model, eos_token_ids=(), max_tokens=24, draft_sources=[source], tree_nodes=8
        )
    ]
    assert got == want


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_random_trees_in_a_batch_give_each_row_its_plain_tokens(model, seed):
    prompts = [
        mx.random.randint(0, 64, (n,), key=mx.random.key(seed + n)).tolist() for n in (4, 11, 17)
    ]
    wants = [plain(model, p, 20) for p in prompts]
    sources = []
    for row, (prompt, want) in enumerate(zip(prompts, wants)):
        sources.append([RandomTrees(len(prompt), want, seed + row)])
    generator = BatchGenerator(model, tree_nodes=8)
    uids = generator.insert(prompts, draft_sources=sources, max_tokens=20, logprobs=1)
    assert drain(generator, uids) == wants


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_the_compacted_cache_equals_one_that_never_drafted(model, data):
    """A tree pass, an accepted path moved into place and the rest trimmed leave the keys and
    values of a cache fed the prompt and the path alone."""
    prompt = data.draw(st.lists(st.integers(0, 63), min_size=2, max_size=14))
    size = data.draw(st.integers(1, 8))
    parents = [data.draw(st.integers(-1, i - 1)) for i in range(size)]
    tokens = data.draw(st.lists(st.integers(0, 63), min_size=size, max_size=size))
    path = path_to(parents, data.draw(st.integers(-1, size - 1)))
    drafted, never = make_cache(model), make_cache(model)
    for cache in (drafted, never):
        model(mx.array([prompt[:-1]]), cache=cache.layers)
    width = 1 + size
    drafted.prepare([width], width, [layout(1, parents, width)])
    model(mx.array([prompt[-1:] + tokens]), cache=drafted.layers)
    drafted.finalize()
    drafted.compact(width, [kept_slots(1, path)])
    drafted.rewind([width - 1 - len(path)])
    model(mx.array([prompt[-1:] + [tokens[node] for node in path]]), cache=never.layers)
    for mine, theirs in zip(drafted.attention, never.attention):
        assert mine.ends[0] - mine.origins[0] == theirs.ends[0] - theirs.origins[0]
        held = slice(mine.ends[0] - len(path) - 1, mine.ends[0])
        same = slice(theirs.ends[0] - len(path) - 1, theirs.ends[0])
        assert mx.allclose(mine.keys[..., held, :], theirs.keys[..., same, :], atol=1e-4)
        assert mx.allclose(mine.values[..., held, :], theirs.values[..., same, :], atol=1e-4)


# A tree over a 6-token vocabulary: the root's children 0, 1, 2; under 1, its children 3 and 4.
TREE = Draft([0, 1, 2, 3, 4], parents=[-1, -1, -1, 1, 1])
LOGITS = mx.array(np.random.default_rng(0).normal(0, 1.5, (6, 6)), mx.float32)


def emitted_pairs(draws: int) -> tuple:
    """Counts of the first emitted token, and of the second after token 1 (node 1)."""
    first, after_one = np.zeros(6), np.zeros(6)
    mx.random.seed(0)
    for _ in range(draws):
        path, next_token = accept_tree(LOGITS, TREE, Sampling(temp=1.0))
        emitted = TREE.path_tokens(path) + [next_token]
        first[emitted[0]] += 1
        if emitted[0] == 1:
            after_one[emitted[1]] += 1
    return first, after_one


def naive_walk(children, tokens, edge_probs, uniforms, node):
    """A wrong rule: each child accepted with p(c), without renormalizing after rejections."""
    rejected = []
    for child in children.get(node, []):
        if uniforms[child] < edge_probs[child]:
            return child, rejected
        rejected.append(tokens[child])
    return None, rejected


def fits(first, after_one) -> bool:
    probs = mx.softmax(LOGITS, axis=-1)
    # node 1 (token 1) is at position 2 of the pass
    return (
        chi_square_p_value(first, np.array(probs[0])) > 1e-3
        and chi_square_p_value(after_one, np.array(probs[2])) > 1e-3
    )


def test_an_empty_draft_is_a_chain_everywhere():
    tree_draft = Draft([5, 6, 7], parents=[-1, -1, 0], chances=[0.5, 0.2, 0.4])
    for empty in (Draft([], parents=[]), tree_draft.truncate(0)):
        assert empty.tokens == [] and empty.parents is None and empty.chances is None


def test_sampled_rows_whose_trees_a_narrow_pass_cuts_to_nothing_are_served():
    """#59: a sampled row whose tree the batch's width cut to no nodes (W = 1) gathered with
    float32 indices and failed. Lookup branches here (four matches of "1 2 3"), and the rows'
    filters differ, as in the issue's requests."""
    prompt = [1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 3, 6, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    model, widths = tiny_llama(), set()
    for seed in range(6):
        generator = BatchGenerator(model, tree_nodes="auto")
        uids = generator.insert(
            [prompt] * 3,
            draft_sources=[[PromptLookupSource()] for _ in range(3)],
            sampling=[Sampling(1.0, top_k=3), Sampling(1.0, min_p=0.2), Sampling(1.0)],
            seed=[seed, seed + 100, seed + 200],
            max_tokens=40,
        )
        drain(generator, uids)  # asserts that no row ends with an error
        widths |= set(generator.stats.widths)
    assert 1 in widths and max(widths) > 2  # narrow passes beside tree passes


def test_sampling_a_tree_keeps_the_target_distribution():
    assert fits(*emitted_pairs(6000))


def test_the_check_rejects_a_rule_that_does_not_renormalize(monkeypatch):
    monkeypatch.setattr(accept, "_walk", naive_walk)
    assert not fits(*emitted_pairs(6000))


def test_lookup_trees_price_other_matches_by_how_often_they_were_right():
    continuations = [[1, 2, 3], [1, 4, 5], [6, 7], [6, 8], [9]]  # best match first
    draft, expected, main_depth = choose(continuations, 0.8, None, 16, 3)
    assert draft.tokens[:3] == [1, 2, 3] and draft.parents[:3] == [-1, 0, 1] and main_depth == 3
    # beside 1, 6 has 2 of the 3 other matches behind it: 2/3 of what 1 leaves
    assert draft.chances[draft.tokens.index(6)] == pytest.approx(0.2 * 2 / 3)
    halved, _, _ = choose(continuations, 0.8, None, 16, 3, second=0.5)
    assert halved.chances[halved.tokens.index(6)] == pytest.approx(0.2 * 2 / 3 * 0.5)
    # never right: only the best match pays
    assert choose(continuations, 0.8, 0.01, 16, 3, second=0.0)[0].tokens == [1, 2, 3]
    # judged along the emitted text where the favoured child was wrong, drafted or not
    assert judge(continuations, [1, 4, 5, 9]) == [True]
    assert judge(continuations, [6, 8]) == [True, True]
    assert judge(continuations, [9]) == [True] and judge(continuations, [10]) == [False]
    assert judge(continuations, [1, 2, 3]) == []


def test_sampling_with_lookup_trees_keeps_the_distribution_of_two_tokens():
    """The whole loop: the first two tokens sampled with lookup trees (which branch) follow the
    target's joint distribution, computed from the model."""
    model = tiny_llama(vocab_size=16, sharp=2.0)
    enable_trees(model)
    from prompt_lookup import PromptLookupSource

    prompt = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]
    first = mx.softmax(model(mx.array([prompt]))[0, -1], axis=-1)
    second = mx.softmax(model(mx.array([[*prompt, t] for t in range(16)]))[:, -1], axis=-1)
    joint = np.array((first[:, None] * second).reshape(-1))
    counts = np.zeros(256)
    mx.random.seed(1)
    for _ in range(3000):
        source = PromptLookupSource(num_draft=2, adaptive=False)
        pair = [
            t
            for t, _ in generate_step(
                prompt,
                model,
                eos_token_ids=(),
                max_tokens=2,
                sampling=Sampling(temp=1.0),
                draft_sources=[source],
                tree_nodes=6,
            )
        ]
        counts[pair[0] * 16 + pair[1]] += 1
    assert chi_square_p_value(counts, joint) > 1e-3


@pytest.mark.parametrize("value", ["-1", "33", "many", "2.5"])
def test_a_bad_tree_nodes_flag_is_one_clear_error(value):
    import main
    from cli import CliError

    with pytest.raises(CliError, match="--tree-nodes must be auto or a count from 0 to 32"):
        main.validate(main.build_parser().parse_args(["--tree-nodes", value]))


def test_main_with_trees_gives_the_chain_output(embedded, tmp_path):
    """``main.py --tree-nodes 8`` prints the text that chains (0) and plain decoding give."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    runs = {}
    for flags in (["--tree-nodes", "8", "--prompt-lookup"], ["--tree-nodes", "0"]):
        done = subprocess.run(
            [sys.executable, "main.py", "--json", "--max-tokens", "48", *flags],
            cwd=Path(__file__).resolve().parent.parent,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        runs[flags[1]] = json.loads(done.stdout)
    assert runs["8"]["tokens"] == runs["0"]["tokens"]


def test_calibration_follows_the_acceptance_measured():
    from decoder.adaptive import Calibration

    calibration = Calibration()
    assert calibration(0.35) == pytest.approx(0.35)  # a calibrated model needs no correction
    for _ in range(200):
        calibration.record([0.3, 0.32, 0.31], 3)  # unconfident, and always right
    assert calibration(0.3) > 0.95
    for _ in range(200):
        calibration.record([0.9, 0.9], 0)  # confident, and wrong: the second is not judged
    assert calibration(0.9) < 0.05


class Clocked:
    """The model under a simulated clock: each pass takes ``1 + per_token * (width - 1)`` and
    drafting takes nothing, so the policy's choices do not depend on this machine's timings."""

    def __init__(self, model, per_token: float):
        self.model, self.per_token, self.now = model, per_token, 0.0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def clock(self) -> float:
        return self.now

    def __call__(self, inputs, cache=None):
        self.now += 1 + self.per_token * (inputs.shape[1] - 1)
        return self.model(inputs, cache=cache)


def mtp_run(path, target, calibrated: bool, tree_nodes=0, **options) -> tuple:
    """``(tokens, passes per token)`` of an MTP layer that predicts the target exactly but says
    it is sure of only a fifth of its top token."""
    from decoder import DecodingStats
    from decoder.pass_cost import PassCost
    from mtp.source import MTPDrafter

    tap, drafter = MTPDrafter.create(target, path, **options)
    draw = drafter._draw

    def unconfident(last, *args):
        tokens, confidence, probs, top = draw(last, *args)
        return tokens, confidence * 0.2, probs, top

    drafter._draw = unconfident
    if not calibrated:
        drafter.calibration = lambda confidence: confidence
        drafter.calibration.record = lambda *args: None
    model, stats = Clocked(tap, per_token=0.05), DecodingStats()
    enable_trees(model)
    tokens = [
        t
        for t, _ in generate_step(
            [5, 7, 11],
            model,
            eos_token_ids=(),
            max_tokens=120,
            draft_sources=[drafter.source()],
            stats=stats,
            pass_cost=PassCost(clock=model.clock),
            tree_nodes=tree_nodes,
        )
    ]
    return tokens, stats.target_forward_passes / len(tokens)


@pytest.fixture(scope="module")
def exact_mtp(tmp_path_factory):
    from tests.mtp_fixtures import write_checkpoint
    from tests.test_mtp import load

    path = tmp_path_factory.mktemp("exact_mtp")
    write_checkpoint(path, "deepseek_v3", seed=2, exact=True, tokenizer=tiny_byte_tokenizer())
    return path, load(path)


def test_calibration_lets_an_unconfident_but_right_mtp_layer_draft_long(exact_mtp):
    """The issue's example: uncalibrated, the confidence stop keeps one token per pass (0.50
    passes per token); calibrated against what is accepted, it drafts as a fixed length of 3
    does, or longer."""
    path, target = exact_mtp
    plain_tokens = plain(target, [5, 7, 11], 120)
    raw, raw_passes = mtp_run(path, target, calibrated=False)
    tokens, passes = mtp_run(path, target, calibrated=True)
    fixed, fixed_passes = mtp_run(path, target, True, num_draft=3, adaptive=False)
    assert raw == tokens == fixed == plain_tokens
    assert raw_passes > 0.45 and passes <= fixed_passes + 0.02, (raw_passes, passes, fixed_passes)


@pytest.mark.parametrize("tree_nodes", ["auto", 6])
def test_mtp_trees_give_plain_tokens(exact_mtp, tree_nodes):
    path, target = exact_mtp
    tokens, _ = mtp_run(path, target, True, tree_nodes=tree_nodes)
    assert tokens == plain(target, [5, 7, 11], 120)


def test_sampling_with_mtp_trees_keeps_the_target_distribution(tmp_path):
    from loading.target import load_mlx_lm
    from mtp.source import MTPDrafter
    from tests.helpers import assert_sampling_keeps_the_target_distribution
    from tests.mtp_fixtures import write_checkpoint

    write_checkpoint(tmp_path, "deepseek_v3", seed=4, vocab_size=8, tokenizer=tiny_byte_tokenizer())
    target, _, _ = load_mlx_lm(tmp_path)
    tap, drafter = MTPDrafter.create(target, tmp_path, num_draft=2, adaptive=False)
    trees = []
    source = count_trees(drafter.source(), trees)
    assert_sampling_keeps_the_target_distribution(
        target, lambda: (tap, [source]), 1.0, 1.0, runs=1500, tree_nodes=4
    )
    assert any(trees)


def test_rows_joining_and_a_kept_cache_stay_lossless_with_trees(model):
    """Rows join a batch that drafts trees mid-way, and a finished row's cache (``keep_caches``)
    serves a later prompt that extends its text: every row gives its plain tokens."""
    prompts = [mx.random.randint(0, 64, (n,), key=mx.random.key(n)).tolist() for n in (5, 12, 9)]
    wants = [plain(model, p, 24) for p in prompts]
    generator = BatchGenerator(model, tree_nodes=8, keep_caches=True)

    def insert(prompt, want, **options):
        source = RandomTrees(len(prompt), want, len(prompt))
        return generator.insert([prompt], draft_sources=[[source]], max_tokens=24, **options)[0]

    uids, tokens, last = [insert(prompts[0], wants[0])], {}, {}
    for step in range(200):
        if step in (2, 5):
            uids.append(insert(prompts[len(uids)], wants[len(uids)]))
        for response in generator.next():
            assert response.error is None
            tokens.setdefault(response.uid, []).extend(response.tokens)
            last[response.uid] = response
        if len(last) == 3 and all(last[uid].finish_reason for uid in uids):
            break
    assert [tokens[uid] for uid in uids] == wants
    kept = last[uids[0]].cache
    text = (prompts[0] + wants[0])[: kept.length] + [7, 8]
    want = plain(model, text, 16)
    uid = generator.insert(
        [text],
        draft_sources=[[RandomTrees(len(text), want, 1)]],
        max_tokens=16,
        prompt_cache=[kept.cut(kept.usable(len(text) - 1))],
    )[0]
    got = []
    while responses := generator.next():
        got += [t for r in responses if r.uid == uid for t in r.tokens]
    assert got == want


def steps_of(choice, count: int, tokens_per_second: dict) -> list:
    """``count`` steps of a loop that asks ``choice`` and records what the kind it chose emits."""
    kinds = []
    for _ in range(count):
        kinds.append(choice.use_trees())
        choice.record(kinds[-1], tokens_per_second[kinds[-1]], 1.0)
    return kinds


def test_auto_measures_both_kinds_then_drafts_the_faster_and_follows_a_change():
    """#60: under "auto" the loops draft chains where trees do not pay on the machine."""
    choice = TreeChoice()
    warmup = steps_of(choice, 2 * TreeChoice.WARMUP, {True: 2.0, False: 3.0})
    assert warmup == [True, False] * TreeChoice.WARMUP  # both measured, in turn
    chains_pay = steps_of(choice, 100, {True: 2.0, False: 3.0})
    assert 0 < chains_pay.count(True) <= 8  # trees probed now and then, gaps up to 16 steps
    trees_pay = steps_of(choice, 300, {True: 4.0, False: 3.0})
    assert trees_pay[-100:].count(False) <= 8  # the change is followed, probe by probe


def test_auto_compares_steps_of_different_batch_sizes_as_speedups():
    """A batch's steps emit more per second at 8 rows than at 1 whatever they draft: told the
    plain speed at each step's size, the choice compares speedups over plain decoding."""
    for told in (True, False):
        choice = TreeChoice()
        for _ in range(2 * TreeChoice.WARMUP):
            if choice.use_trees():  # trees at 8 rows (plain: 8 tokens per 0.125 s), 1.2x plain
                choice.record(True, 77, 1.0, plain=0.125 / 8 if told else 1.0)
            else:  # chains at 1 row (plain: a token per 0.1 s), 1.5x plain
                choice.record(False, 15, 1.0, plain=0.1 if told else 1.0)
        # the first choice after the warmup is no probe (``Backoff``)
        assert choice.use_trees() is not told  # raw rates, 77 against 15 a second: trees


class Always:
    """A ``TreeChoice`` that always says ``trees``."""

    def __init__(self, trees: bool):
        self.trees = trees

    def use_trees(self) -> bool:
        return self.trees

    def record(self, *args):
        pass


class TwoGuesses(DraftSource):
    """The next plain token (``truth``), with a wrong one beside it when asked for a tree."""

    name = "two_guesses"

    def __init__(self, prompt_length: int, truth: list):
        self.prompt_length, self.truth = prompt_length, truth

    def propose(self, tokens, max_draft, max_nodes=None):
        done = len(tokens) - self.prompt_length
        chain = Draft(self.truth[done : done + 1]) if done < len(self.truth) else None
        if max_nodes is None:
            return chain
        return chain and Draft(chain.tokens + [(chain.tokens[0] + 1) % 64], parents=[-1, -1])


@pytest.mark.parametrize("trees", [True, False])
def test_auto_drafts_what_the_choice_says_in_both_loops(model, trees, monkeypatch):
    """Trees when the choice says so, chains otherwise, and the plain tokens either way, one row
    and a batch."""
    prompt = [1, 2, 3, 4, 5]
    want, shapes = plain(model, prompt, 12), []
    monkeypatch.setattr(loop, "TreeChoice", lambda: Always(trees))
    source = count_trees(TwoGuesses(len(prompt), want), shapes)
    steps = generate_step(
        prompt, model, eos_token_ids=(), max_tokens=12, draft_sources=[source], tree_nodes="auto"
    )
    assert [t for t, _ in steps] == want
    generator = BatchGenerator(model, tree_nodes="auto")
    generator.trees = defaultdict(lambda: Always(trees))
    sources = [[count_trees(TwoGuesses(len(prompt), want), shapes)] for _ in range(2)]
    uids = generator.insert([prompt, prompt], draft_sources=sources, max_tokens=12)
    assert drain(generator, uids) == [want, want]
    assert all(shapes) and len(shapes) > 3 if trees else shapes == []
