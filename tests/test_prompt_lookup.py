"""Prompt lookup: the vectorized search against brute force, the source against
the search, adaptive drafting, and lossless decoding with a tiny random llama."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decoder import DecodingStats, generate_step
from decoder.acceptance import Backoff
from decoder.pass_cost import PassCost
from prompt_lookup import PromptLookupSource, find_draft
from prompt_lookup.ngram import LONGEST_LOOKBACK
from tests.helpers import end_with_a_match, target_accepts, tiny_llama

VOCAB = 64
MODEL = tiny_llama(vocab_size=VOCAB)


def reference_draft(tokens, extra_context, ngram_max, ngram_min, num_draft):
    """Brute force: list every earlier occurrence of each n-gram size, one by one."""
    segments = [list(extra_context), list(tokens)]  # oldest first
    for ngram in range(ngram_max, ngram_min - 1, -1):
        if len(tokens) < ngram:
            continue
        suffix = tokens[len(tokens) - ngram :]
        # (segment, start): the n-gram ends right before `start`, which must hold a token.
        occurrences = [
            (segment, start)
            for segment in segments
            for start in range(ngram, len(segment))
            if segment[start - ngram : start] == suffix
        ]
        if not occurrences:
            continue
        lookback = min(max(LONGEST_LOOKBACK, ngram_max), len(tokens))

        def agreement(occurrence):
            segment, start = occurrence
            back = 0
            while back < min(lookback, start) and segment[start - 1 - back] == tokens[-1 - back]:
                back += 1
            return back

        longest = max(map(agreement, occurrences))
        segment, start = [o for o in occurrences if agreement(o) == longest][-1]
        return segment[start : start + num_draft]
    return []


@st.composite
def token_lists(draw, count, max_size):
    """``count`` token lists over a vocabulary of 1 to 3 ids, so that n-grams recur
    often and their occurrences differ in how far back they agree."""
    vocab = st.integers(0, draw(st.integers(0, 2)))
    sizes = [draw(st.integers(0, max_size)) for _ in range(count)]  # not biased to short lists
    return [draw(st.lists(vocab, min_size=size, max_size=size)) for size in sizes]


search_args = st.fixed_dictionaries(
    {
        "ngram_max": st.integers(1, 5),
        "ngram_min": st.integers(1, 5),
        "num_draft": st.integers(1, 10),
    }
).filter(lambda args: args["ngram_min"] <= args["ngram_max"])


@settings(max_examples=300, deadline=None)
@given(lists=token_lists(2, max_size=60), args=search_args)
def test_search_matches_brute_force(lists, args):
    tokens, extra_context = lists
    expected = reference_draft(tokens, extra_context, **args)
    assert find_draft(tokens, extra_context=extra_context, **args) == expected


@settings(max_examples=60, deadline=None)
@given(
    lists=token_lists(3, max_size=30),
    steps=st.lists(st.integers(1, 4), max_size=12),
    args=search_args,
)
def test_source_follows_appended_tokens(lists, steps, args):
    """The source's incremental context against a fresh search as tokens arrive."""
    prompt, generated, extra_context = lists
    source = PromptLookupSource(extra_context=extra_context, adaptive=False, **args)
    tokens = list(prompt)
    for num_new in [0] + steps:
        tokens.extend(generated[:num_new])
        generated = generated[num_new:]
        expected = find_draft(tokens, extra_context=extra_context, **args)
        draft = source.propose(tokens, max_draft=args["num_draft"])
        assert (draft.tokens if draft else []) == expected
        draft = source.propose(tokens, max_draft=1)
        assert (draft.tokens if draft else []) == expected[:1]


def test_edge_cases():
    assert find_draft([]) == []
    assert find_draft([5]) == []
    assert find_draft([1, 2, 3]) == []  # nothing repeats
    assert find_draft([5, 5]) == [5]
    # The suffix is longer than the context: fall back to the sizes that fit.
    assert find_draft([1, 2, 1], ngram_max=5) == [2, 1]
    # Matches at the very end of a segment have no continuation and are skipped,
    # including the suffix itself; nothing leaks across the segments.
    assert find_draft([1, 2], extra_context=[7, 1, 2]) == []
    assert find_draft([3, 1, 2], extra_context=[1, 2]) == []
    # extra_context is copied from, and stops at its own end.
    assert find_draft([1, 5, 6], extra_context=[4, 5, 6, 7, 8]) == [7, 8]
    # A continuation that runs to the end of the tokens stops there.
    assert find_draft([1, 2, 3, 1, 2], num_draft=10) == [3, 1, 2]
    assert find_draft([1, 2, 3, 1, 2], num_draft=2) == [3, 1]


def test_larger_ngram_wins_over_recent_smaller_one():
    tokens = [1, 2, 3, 4, 7, 3, 5, 1, 2, 3]  # [3] alone recurs more recently
    assert find_draft(tokens, num_draft=3) == [4, 7, 3]
    assert find_draft([1, 2, 3, 1], ngram_min=2) == []
    assert find_draft([1, 2, 3, 1], ngram_min=1) == [2, 3, 1]


def test_the_occurrence_that_agrees_furthest_back_is_copied():
    tokens = [6, 1, 2, 5, 1, 3, 7, 1, 4, 5, 1]
    assert find_draft(tokens, ngram_max=1, num_draft=1) == [3]  # preceded by 5, like the end
    assert find_draft([1, 2, 1, 3, 1], ngram_max=1, num_draft=1) == [3]  # a tie: the most recent


@pytest.mark.parametrize(
    "kwargs", [dict(ngram_min=0), dict(ngram_min=4, ngram_max=3), dict(num_draft=0)]
)
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        PromptLookupSource(**kwargs)
    with pytest.raises(ValueError):
        find_draft([1, 1], **kwargs)


PERIOD = 40  # longer than any draft, so every lookup has a full continuation


def drive(source, outcomes, tokens=None):
    """Run ``source`` like generate_step with a scripted verifier on a periodic
    sequence: each outcome accepts all of the draft (True) or none of it (False).
    Returns the draft length of each step, 0 where the source did not draft."""
    tokens = list(range(PERIOD)) * 2 if tokens is None else tokens
    lengths = []
    for accept_all in outcomes:
        draft = source.propose(tokens, max_draft=100)
        num_proposed = len(draft.tokens) if draft else 0
        num_accepted = num_proposed if accept_all else 0
        # Accepted tokens plus the target's own; the sequence stays periodic either way.
        for _ in range(num_accepted + 1):
            tokens.append(tokens[-PERIOD])
        source.update(tokens, num_proposed, num_accepted)
        lengths.append(num_proposed)
    return lengths


def test_adaptive_starts_at_num_draft_and_grows_on_full_acceptance_up_to_a_cap():
    lengths = drive(PromptLookupSource(num_draft=4), [True] * 6)
    assert lengths[0] == 4 and lengths == sorted(lengths) and lengths[-1] == 8
    assert drive(PromptLookupSource(num_draft=4, adaptive=False), [True] * 3) == [4, 4, 4]


def test_adaptive_shrinks_after_a_partial_acceptance():
    source = PromptLookupSource(num_draft=8)
    tokens = list(range(PERIOD)) * 2
    assert len(source.propose(tokens, 100).tokens) == 8
    tokens.extend(tokens[-PERIOD : -PERIOD + 3])  # 2 accepted, then the target's token
    source.update(tokens, 8, 2)
    assert 1 <= len(source.propose(tokens, 100).tokens) < 8


def test_draft_length_follows_the_cost_model():
    source = PromptLookupSource(num_draft=8, ngram_max=4)
    # nothing timed: one more token costs 0.1 of a step
    source.reset(PassCost(default_token_cost=0.1))
    tokens = []  # one sequence, so that the source keeps what it learns about each size of match
    for ngram, num_accepted in ((4, 9), (3, 4), (2, 1), (1, 0)):
        end_with_a_match(tokens, ngram)
        target_accepts(source, tokens, num_accepted)  # a = num_accepted / (num_accepted + 1)
    # a = 0.9: 0.9**21 > 0.1 > 0.9**22, capped at 16; a = 0.8: 0.8**10 > 0.1 > 0.8**11;
    # a = 0.5: 0.5**3 > 0.1 > 0.5**4; a = 0 < cost: do not draft.
    assert [source.draft_length(n) for n in (4, 3, 2, 1)] == [16, 10, 3, 0]


def estimates(source, kind):
    """What ``source`` expects from copies of each length after a match of ``kind``."""
    return [source.expected_speedup(kind, length) for length in range(1, 9)]


@pytest.mark.parametrize(
    "emitted,num_accepted",
    [
        (
            [3, 9],
            1,
        ),  # agrees with the first emitted token, then not: one accepted, then a rejection
        ([3], 1),  # agrees with all that was emitted, and is longer: censored, no rejection known
        ([3, 4, 1, 2, 5], 4),  # all of it agrees: a fully accepted copy
        ([7, 3], 0),
    ],
)
def test_a_copy_another_source_drafted_over_is_scored_as_if_verified(emitted, num_accepted):
    tokens = [1, 2, 3, 4, 1, 2]  # a 2-gram match
    scored, verified = PromptLookupSource(), PromptLookupSource()
    assert scored.propose(tokens, 8).tokens == [3, 4, 1, 2]
    before = estimates(scored, 2)
    scored.update(tokens + emitted, 0, 0)  # another source drafted; these tokens were emitted
    # The same copy, cut to what was emitted, verified by the target.
    draft = verified.propose(tokens, len(emitted))
    verified.update(tokens + emitted, len(draft.tokens), num_accepted)
    assert estimates(scored, 2) == estimates(verified, 2) != before
    scored.update(tokens + emitted + [0], 0, 0)  # no copy offered since: nothing to score
    assert estimates(scored, 2) == estimates(verified, 2)


def gaps(lengths):
    """Lengths of the runs of steps without a draft."""
    runs, run = [], 0
    for length in lengths:
        if length == 0:
            run += 1
        elif run:
            runs, run = runs + [run], 0
    return runs


def test_adaptive_backs_off_exponentially_and_resumes():
    source = PromptLookupSource(num_draft=4)
    tokens = list(range(PERIOD)) * 2
    misses = drive(source, [False] * 400, tokens)
    assert misses[0] == 4  # then shorter drafts, then none but probes
    drafted = [m for m in misses if m]
    assert drafted == sorted(drafted, reverse=True)
    pauses = gaps(misses)
    assert pauses == [min(2**i, Backoff.MAX_GAP) for i in range(len(pauses))]
    assert pauses.count(Backoff.MAX_GAP) >= 3  # reached the cap and stayed there
    assert sum(misses[100:]) <= 300 / Backoff.MAX_GAP + 1  # probing is rare once paused

    # Accepted probes resume drafting and grow it again.
    hits = drive(source, [True] * 120, tokens)
    first_probe = next(i for i, length in enumerate(hits) if length)
    resumed = hits[first_probe:]
    assert resumed[0] == 1 and max(resumed) == source.max_draft_length
    assert 0 not in resumed[resumed.index(source.max_draft_length) :]

    never_pauses = drive(PromptLookupSource(num_draft=4, adaptive=False), [False] * 20)
    assert never_pauses == [4] * 20


def test_a_new_sequence_starts_over():
    source = PromptLookupSource(num_draft=4)
    drive(source, [False] * 3)  # paused on the first sequence
    other = [7, 8, 9, 7, 8]
    assert source.propose(other, 100).tokens == find_draft(other, num_draft=4) == [9, 7, 8]


def test_greedy_decoding_is_lossless():
    accepted_per_example = []

    @settings(max_examples=40, deadline=None)
    @given(
        pattern=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
        repeats=st.integers(1, 4),
        tail=st.lists(st.integers(0, VOCAB - 1), max_size=4),
        extra_context=st.lists(st.integers(0, VOCAB - 1), max_size=8),
        max_tokens=st.integers(1, 40),
        num_draft=st.integers(1, 8),
        adaptive=st.booleans(),
    )
    def check(pattern, repeats, tail, extra_context, max_tokens, num_draft, adaptive):
        prompt = pattern * repeats + tail
        plain = [
            t for t, _ in generate_step(prompt, MODEL, max_tokens=max_tokens, eos_token_ids=())
        ]
        stats = DecodingStats()
        source = PromptLookupSource(
            num_draft=num_draft, extra_context=extra_context, adaptive=adaptive
        )
        drafted = [
            t
            for t, _ in generate_step(
                prompt,
                MODEL,
                draft_sources=[source],
                max_tokens=max_tokens,
                stats=stats,
                eos_token_ids=(),
            )
        ]
        assert drafted == plain
        # Each pass yields its accepted draft tokens plus one of its own.
        accepted = stats.draft_accepted
        assert stats.target_forward_passes == len(drafted) - accepted
        accepted_per_example.append(accepted)

    check()
    # Not vacuous: the lookups hit, and then the loop needed fewer passes than tokens.
    assert sum(accepted > 0 for accepted in accepted_per_example) >= len(accepted_per_example) // 4
