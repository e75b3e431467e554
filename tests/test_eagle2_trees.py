"""EAGLE-2 trees from a draft head and MTP layers (decoder/tree_growth.py): the nodes taken are
the best by path chance and hold their parents; trees grow below the model's other choices (and
do not with a frontier of one, the control); greedy decoding with them equals plain decoding,
alone and in a batch where rows join and leave; the head's cache after each tree holds what it
held before."""

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batch import BatchGenerator
from decoder import enable_trees
from decoder.hidden_states import output_rows
from decoder.model_drafter import ALTERNATIVES
from decoder.tree import depths
from decoder.tree_growth import TreeGrowth, best_nodes
from draft_head.head import DraftHead, head_args
from draft_head.source import HeadDrafter
from mtp.source import MTPSource
from tests.helpers import tiny_byte_tokenizer, tiny_llama
from tests.mtp_fixtures import write_checkpoint
from tests.test_batch import alone, assert_same_or_near_tie, run
from tests.test_draft_trees import mtp_run, plain
from tests.test_mtp import load

VOCAB = 64


def grown(data, width: int, calibration) -> TreeGrowth:
    """A tree grown a few depths from random top-3 distributions, its frontier chosen as the
    drafter chooses it."""
    growth, frontier, chain = TreeGrowth(width, calibration), [-1], -1
    for _ in range(data.draw(st.integers(1, 4))):
        drawn = []
        for parent in frontier:
            weights = data.draw(st.lists(st.floats(0.01, 1.0), min_size=3, max_size=3))
            q = sorted((w / (sum(weights) + 0.5) for w in weights), reverse=True)
            top = [(rank, 10 * len(growth.nodes) + rank, p) for rank, p in enumerate(q)]
            children = growth.add_children(parent, top, q[0])
            chain = children[0] if parent == chain else chain
            drawn += children
        frontier = [chain] + growth.frontier(drawn, chain, 0.0)
    return growth


@settings(max_examples=60, deadline=None)
@given(data=st.data(), max_nodes=st.integers(1, 12), threshold=st.none() | st.floats(0.0, 0.3))
def test_a_tree_takes_the_nodes_of_highest_chance_each_after_its_parent(data, max_nodes, threshold):
    growth = grown(data, width=3, calibration=lambda confidence: confidence)
    taken = best_nodes(growth.nodes, max_nodes, threshold)
    chances = [growth.nodes[node].chance for node in taken]
    assert len(taken) <= max_nodes and chances == sorted(chances, reverse=True)
    for position, node in enumerate(taken):  # closed under parents: each prefix is a tree
        assert growth.nodes[node].parent in [-1] + taken[:position]
    left = [n.chance for i, n in enumerate(growth.nodes) if i not in taken]
    if threshold is not None:
        assert all(chance > threshold for chance in chances)
    if left and len(taken) == max_nodes:
        assert max(left) <= min(chances)
    elif left:
        assert threshold is not None and max(left) <= threshold
    draft, expected = growth.tree(max_nodes, threshold)
    assert draft.tokens == [growth.nodes[node].token for node in taken]
    assert depths(draft.parents or []) == [growth.nodes[node].depth for node in taken]  # none: []
    assert expected == pytest.approx(1 + sum(chances))


def test_on_a_tie_the_parent_goes_first():
    """A model sure of every token (calibrated chance 1) gives the chain its parent's chance."""
    growth = TreeGrowth(2, calibration=lambda confidence: 1.0)
    parent = -1
    for token in (5, 6, 7):
        parent = growth.add_children(parent, [(token, token, 0.9), (1, 1, 0.1)], 0.9)[0]
    draft, _ = growth.tree(2, None)
    assert draft.tokens == [5, 6] and draft.parents == [-1, 0]


def branches_below_other_choices(parents: list) -> bool:
    """Whether two nodes of one depth both have children: a chain with leaves beside it has at
    most one per depth."""
    inner = {parent for parent in parents if parent >= 0}
    node_depths = depths(parents)
    return len({node_depths[node] for node in inner}) < len(inner)


def recording(source_class, monkeypatch) -> list:
    """The parents of every tree sources of ``source_class`` propose, as they propose them."""
    trees, propose = [], source_class.propose

    def recorded(self, *args):
        draft = propose(self, *args)
        if draft is not None and draft.parents is not None:
            trees.append(draft.parents)
        return draft

    monkeypatch.setattr(source_class, "propose", recorded)
    return trees


def head_drafter(seed: int, **options) -> tuple:
    """``(target, tap, drafter)``: a random head over the whole vocabulary of a tiny Llama, unsure
    enough that its other choices are worth growing."""
    target = tiny_llama(vocab_size=VOCAB, num_layers=3, seed=0)
    mx.random.seed(seed)
    vocab_ids = mx.arange(VOCAB)
    head = DraftHead(head_args(target.args), output_rows(target, vocab_ids))
    return (target, *HeadDrafter.around(target, head, vocab_ids, **options))


@pytest.mark.parametrize("width", [1, ALTERNATIVES])
def test_head_trees_grow_below_other_choices_and_give_plain_tokens(width, monkeypatch):
    """With a frontier of ``ALTERNATIVES`` nodes the trees branch below the head's other
    choices; with one (the control) they cannot."""
    target, tap, drafter = head_drafter(seed=3, num_draft=4, adaptive=False)
    enable_trees(tap)
    drafter.tree_width = width
    trees = recording(type(drafter.source()), monkeypatch)
    prompt = [3, 9, 27, 17, 51, 25]
    got = alone(tap, prompt, 40, [drafter.source()], eos=(), tree_nodes=10)
    assert got == alone(target, prompt, 40, eos=())
    assert trees and any(map(branches_below_other_choices, trees)) == (width > 1)


def test_mtp_trees_grow_below_other_choices_and_give_plain_tokens(tmp_path, monkeypatch):
    """An MTP layer right often, not always, so that its other choices have a chance."""
    write_checkpoint(
        tmp_path, "deepseek_v3", seed=1, exact=True, noise=0.08, tokenizer=tiny_byte_tokenizer()
    )
    target = load(tmp_path)
    trees = recording(MTPSource, monkeypatch)
    tokens, _ = mtp_run(tmp_path, target, True, tree_nodes=10)
    assert tokens == plain(target, [5, 7, 11], 120)
    assert any(map(branches_below_other_choices, trees))


def held(cache) -> list:
    """Per attention layer and row: the positions it holds, its keys and its values there."""
    found = []
    for layer in cache.attention:
        for row in range(layer.rows):
            start, end = layer.starts[row], layer.ends[row]
            found.append(
                (
                    end - layer.origins[row],
                    layer.keys[row, :, start:end],
                    layer.values[row, :, start:end],
                )
            )
    mx.eval(found)
    return found


def test_head_trees_in_a_batch_give_plain_tokens_and_leave_the_cache_as_it_was():
    """Rows join and one leaves while every row drafts trees; each tree's copies of the head's
    cache rows go, leaving each row the positions, keys and values it held before."""
    target, tap, drafter = head_drafter(seed=5, num_draft=3, adaptive=False)
    chain, next_position, forked = drafter._chain, drafter._next, []

    def checked_chain(*args):
        before = held(drafter.cache)
        result = chain(*args)
        after = held(drafter.cache)
        assert [length for length, _, _ in after] == [length for length, _, _ in before]
        for (_, keys, values), (_, old_keys, old_values) in zip(after, before):
            assert mx.array_equal(keys, old_keys) and mx.array_equal(values, old_values)
        return result

    def counted(last, indices):
        forked.append(last.shape[0] > len(drafter.rows))
        return next_position(last, indices)

    drafter._chain, drafter._next = checked_chain, counted
    rows = [([3, 9, 27], 20, 0), (list(range(1, 40, 3)), 20, 0), ([8], 16, 1), ([60] * 9, 20, 3)]
    specs = [
        dict(prompt=prompt, max_tokens=n, join=join, draft_sources=[drafter.source()])
        for prompt, n, join in rows
    ]
    generator = BatchGenerator(tap, eos_token_ids=(), drafters=[drafter], tree_nodes=8)
    out, finish, errors, _ = run(generator, specs, remove_at={1: 4})
    for (prompt, n, _), tokens, reason, error in zip(rows, out, finish, errors):
        assert error is None
        if reason != "removed":
            assert_same_or_near_tie(target, prompt, tokens, alone(target, prompt, n, eos=()))
    assert any(forked)
