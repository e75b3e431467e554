"""Ragged passes: the packed dense layers score real tokens as the padded pass does, the cost
model learns what padding costs, and the policy spends draft tokens where they are worth most."""

import mlx.core as mx
import numpy as np
import pytest

from batch import BatchGenerator
from batch_cache import prefill_rows, trim_rows
from batch_pass import PACK_MULTIPLE, can_pack, computed_tokens, ragged_logits
from batch_policy import choose_drafts
from cost import PassCost
from prompt_lookup.ngram import PromptLookupSource
from tests.helpers import tiny_llama

VOCAB = 64
MODEL = tiny_llama(vocab_size=VOCAB, num_layers=2, hidden_size=32, seed=0)


@pytest.mark.parametrize("lengths", [[1, 3, 2, 1, 4], [4, 1, 1, 1, 1], [2, 2, 2, 2, 1]])
def test_a_ragged_pass_scores_real_tokens_and_fills_the_cache_as_a_padded_pass_does(lengths):
    rng = np.random.default_rng(sum(lengths))
    prompts = [rng.integers(0, VOCAB, size).tolist() for size in (5, 9, 3, 12, 7)]
    ragged_cache, padded_cache = prefill_rows(MODEL, prompts), prefill_rows(MODEL, prompts)
    width = max(lengths)
    inputs = mx.array(rng.integers(0, VOCAB, (len(prompts), width)))
    packed = ragged_logits(MODEL, inputs, lengths, ragged_cache)
    padded = MODEL(inputs, cache=padded_cache)
    for row, length in enumerate(lengths):
        assert mx.allclose(packed[row, :length], padded[row, :length], atol=1e-4).item()
    # Each row keeps its real tokens; the next pass then reads the same cache either way.
    counts = [width - length for length in lengths]
    trim_rows(ragged_cache, counts)
    trim_rows(padded_cache, counts)
    step = mx.array(rng.integers(0, VOCAB, (len(prompts), 1)))
    assert mx.allclose(MODEL(step, cache=ragged_cache), MODEL(step, cache=padded_cache), atol=1e-4).item()


def test_only_llama_layouts_are_packed_and_the_tokens_round_up_to_the_tile():
    assert can_pack(MODEL) and not can_pack(object())
    assert computed_tokens(8, 2, 9) == 16 and computed_tokens(8, 3, 17) == 24
    assert computed_tokens(1, 5, 5) == 5  # never more than the padded pass: one row is never padded
    assert computed_tokens(8, 4, 8 + PACK_MULTIPLE) == 8 + PACK_MULTIPLE


def test_the_cost_model_learns_what_a_padded_slot_costs():
    cost = PassCost(default_token_cost=0.1)
    base, slope, width_slope = 0.1, 0.03, 0.004  # seconds: per real token of width, per padded slot
    for _ in range(40):
        for width, tokens in ((1, 8), (2, 16), (3, 24), (3, 16), (5, 16), (6, 24)):
            per_row = tokens / 8
            cost.record(base + slope * (per_row - 1) + width_slope * (width - per_row), width, rows=8, tokens=tokens)
    assert cost.relative(5, rows=8, tokens=16) == pytest.approx(1 + (slope + 3 * width_slope) / base, rel=0.02)
    assert cost.relative(2, rows=8) == pytest.approx(1 + slope / base, rel=0.02)
    # Before any ragged pass is timed, a padded slot is priced at the prior share of a token.
    fresh = PassCost(default_token_cost=0.1)
    fresh.record(0.1, 1, rows=8)
    fresh.record(0.13, 2, rows=8)
    line = fresh.relative(2, rows=8) - 1
    assert fresh.relative(3, rows=8, tokens=16) == pytest.approx(1 + line * (1 + PassCost.PADDING_SHARE))


def test_the_policy_gives_draft_tokens_to_the_rows_likely_to_keep_them():
    cost = PassCost(default_token_cost=0.2)
    drafts, acceptance = [6] + [1] * 7, [1.0] + [0.0] * 7
    # Padded, every row pays for the long draft's width: not worth it. Ragged, the one row drafts.
    assert choose_drafts(drafts, acceptance, cost, ragged=False) == [0] * 8
    assert choose_drafts(drafts, acceptance, cost) == [6] + [0] * 7
    assert choose_drafts(drafts, acceptance, cost, max_width=6) == [5] + [0] * 7
    assert choose_drafts(drafts, acceptance, cost, max_width=3) == [0] * 8  # 2 tokens cost a tile of 8
    assert choose_drafts([0] * 8, [0.9] * 8, cost) == [0] * 8


def test_ragged_and_padded_passes_give_every_row_the_same_output():
    prompts = [[5, 6, 7, 8, 9, 10] * 3 + [i] for i in range(3)] + [[11, 12, 13] * 5, [20, 21]]
    outputs, costs = [], []
    for ragged in (True, False):
        generator = BatchGenerator(MODEL, ragged_passes=ragged, pass_cost=PassCost(default_token_cost=0.01))
        uids = generator.insert(prompts, max_tokens=30, draft_sources=[[PromptLookupSource()] for _ in prompts])
        out = {uid: [] for uid in uids}
        while responses := generator.next():
            for response in responses:
                out[response.uid] += response.tokens
        outputs.append(out)
        costs.append(generator.cost)
    assert outputs[0] == outputs[1]
    assert costs[0].ragged and not costs[1].ragged  # the ragged engine did run ragged passes
