"""Draft trees in constrained rows: each node masked after its own path, the text the constraint
forces drafted below a leaf, and the output equal to plain constrained decoding."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch import BatchGenerator
from constrained import ForcedTextSource, RegexConstraint
from constrained.grammar import GrammarConstraint, GrammarForcedSource
from decoder import DecodingStats, enable_trees, generate_step
from decoder.constrain import constrain_tree
from decoder.draft import Draft
from decoder.tree import path_to
from tests.helpers import drain, tiny_byte_tokenizer, tiny_llama
from tests.test_draft_trees import RandomTrees

TOKENIZER = tiny_byte_tokenizer()
VOCAB = len(TOKENIZER)
EOS = [TOKENIZER.eos_token_id]
MODEL = tiny_llama(vocab_size=VOCAB, num_layers=2, hidden_size=32, seed=7, sharp=3.0)
enable_trees(MODEL)
PATTERN = r'\{"name": "[a-c]{1,8}", "age": \d{1,3}\}'
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def encode(text: str) -> list:
    return TOKENIZER.encode(text, add_special_tokens=False)


def regex():
    constraint = RegexConstraint.from_regex(PATTERN, TOKENIZER, VOCAB)
    return constraint, ForcedTextSource(constraint)


def grammar():
    constraint = GrammarConstraint.from_json_schema(SCHEMA, TOKENIZER, VOCAB)
    return constraint, GrammarForcedSource(constraint)


def check_masks(constraint, draft, masks):
    """Each position's mask is the chain's along the node's own path."""
    assert (masks[0] == constraint.masks(constraint.walk([]))[0]).all().item()
    for node in range(len(draft.tokens)):
        path = draft.path_tokens(path_to(draft.parents, node))
        states = constraint.walk(path)
        assert len(states) == len(path) + 1  # every node kept is allowed
        assert (masks[node + 1] == constraint.masks(states)[-1]).all().item()


@pytest.mark.parametrize(
    "make, opening, closed, forced",
    [(regex, '{"name": "', '"', ', "age": '), (grammar, '{"name":"', '"', ',"age":')],
    ids=["regex", "grammar"],
)
def test_forbidden_nodes_go_each_node_is_masked_after_its_path_and_leaves_get_forced_text(
    make, opening, closed, forced
):
    constraint, _ = make()
    constraint.advance(encode(opening))
    a, b, c, quote, seven = (encode(text)[0] for text in ("a", "b", "c", closed, "7"))
    # a -> {b -> ", c, 7}, and a " that would close an empty name first (the regex forbids it;
    # the schema allows it). Under the regex, 7 is forbidden in a name.
    draft = Draft([a, quote, b, quote, c, seven], parents=[-1, -1, 0, 2, 0, 0])
    got, masks = constrain_tree(constraint, draft, max_depth=16)
    texts = {
        TOKENIZER.decode(got.path_tokens(path_to(got.parents, node)))
        for node in range(len(got.tokens))
    }
    assert 'ab"' + forced in texts  # the leaf closing the name drafts what follows
    assert "ac" in texts and 'ab"' + forced + "x" not in texts
    if make is regex:
        assert not any(text.startswith(('"', "a7")) for text in texts)
    check_masks(constraint, got, masks)


def decode(constraint, source=None, prompt=(1, 2), tree_nodes=0, seed=0) -> tuple:
    stats = DecodingStats()
    steps = generate_step(
        list(prompt),
        MODEL,
        eos_token_ids=EOS,
        max_tokens=40,
        constraint=constraint,
        draft_sources=[] if source is None else [source],
        tree_nodes=tree_nodes,
        stats=stats,
    )
    return [token for token, _ in steps], stats


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    make=st.sampled_from([regex, grammar]),
    prompt=st.lists(st.integers(0, 255), min_size=1, max_size=6),
    seed=st.integers(0, 10**6),
)
def test_constrained_rows_with_random_trees_give_plain_constrained_tokens(make, prompt, seed):
    want, _ = decode(make()[0], prompt=prompt)
    constraint, _ = make()
    trees = RandomTrees(len(prompt), want, seed)  # the constraint drafts its forced text below
    got, stats = decode(constraint, trees, prompt, tree_nodes=8)
    assert got == want
    assert stats.sources["random_trees"].accepted > 0  # trees were verified, not only chains


def test_constrained_rows_in_a_batch_draft_trees_and_stay_lossless():
    prompts = [[random.Random(n).randrange(256) for _ in range(n)] for n in (3, 7)]
    makes = [regex, grammar]
    wants = [decode(make()[0], prompt=prompt)[0] for make, prompt in zip(makes, prompts)]
    generator = BatchGenerator(MODEL, tree_nodes=8)
    constraints, sources = [], []
    for row, (make, prompt, want) in enumerate(zip(makes, prompts, wants)):
        constraint, forced = make()
        constraints.append(constraint)
        sources.append([forced, RandomTrees(len(prompt), want, row)])
    uids = generator.insert(
        prompts, draft_sources=sources, constraint=constraints, max_tokens=40, eos_token_ids=EOS
    )
    assert drain(generator, uids) == wants
