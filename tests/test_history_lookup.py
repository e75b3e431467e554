"""History lookup: lossless greedy decoding, drafts from the store, the store's bound,
atomic writes, concurrent writers, and the CLI flag end to end."""

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decoder import DecodingStats, generate_step
from decoder.pass_cost import PassCost
from prompt_lookup import PromptLookupSource
from prompt_lookup.history import (
    HistoryError,
    HistoryLookupSource,
    append_history,
    bound_history,
    join_outputs,
    load_history,
)
from prompt_lookup.ngram import SEPARATOR
from tests.helpers import end_with_a_match, target_accepts, tiny_llama

VOCAB = 64
MODEL = tiny_llama(vocab_size=VOCAB)
ROOT = Path(__file__).parent.parent


def plain(prompt, max_tokens):
    return [t for t, _ in generate_step(prompt, MODEL, max_tokens=max_tokens, eos_token_ids=())]


@settings(max_examples=40, deadline=None)
@given(
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
    outputs=st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=20), max_size=4),
    include_plain=st.booleans(),
    max_tokens=st.integers(1, 40),
    num_draft=st.integers(1, 8),
    max_history_tokens=st.integers(1, 64),
)
def test_greedy_decoding_is_lossless(
    prompt, outputs, include_plain, max_tokens, num_draft, max_history_tokens
):
    reference = plain(prompt, max_tokens)
    # The model's own output in the store is the case that drafts the most.
    history = join_outputs(outputs + ([reference] if include_plain else []))
    source = HistoryLookupSource(
        history, max_history_tokens=max_history_tokens, num_draft=num_draft
    )
    stats = DecodingStats()
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
    assert drafted == reference
    assert stats.target_forward_passes == len(drafted) - stats.draft_accepted


def test_a_remembered_output_is_drafted_next_time():
    prompt = [40, 41]  # its output is not a short loop, so the store is what drafts it
    reference = plain(prompt, 30)
    source = HistoryLookupSource(num_draft=8)
    first, second = DecodingStats(), DecodingStats()
    list(
        generate_step(
            prompt, MODEL, draft_sources=[source], max_tokens=30, stats=first, eos_token_ids=()
        )
    )
    source.remember(reference)
    again = [
        t
        for t, _ in generate_step(
            prompt, MODEL, draft_sources=[source], max_tokens=30, stats=second, eos_token_ids=()
        )
    ]
    assert again == reference
    # The whole answer is in the store: drafts cover nearly all of it.
    assert second.target_forward_passes <= 6
    assert second.target_forward_passes < first.target_forward_passes


def test_reset_keeps_the_store_and_forgets_the_generation():
    source = HistoryLookupSource(join_outputs([[5, 6, 7, 8]]), num_draft=3, adaptive=False)
    assert source.propose([9, 5, 6], 8).tokens == [7, 8]
    source.reset()
    assert source.propose([4, 5], 8).tokens == [6, 7, 8]


def test_bound_drops_the_oldest_whole_outputs():
    history = join_outputs([[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    assert bound_history(history, 100).tolist() == history.tolist()
    assert bound_history(history, 5).tolist() == [6, 7, 8, 9, SEPARATOR]
    assert bound_history(history, 8).tolist() == [4, 5, SEPARATOR, 6, 7, 8, 9, SEPARATOR]
    # Seven tokens would cut [4, 5] in half: it goes too.
    assert bound_history(history, 7).tolist() == [6, 7, 8, 9, SEPARATOR]
    assert bound_history(history, 3).tolist() == []


def test_store_round_trip_and_bound(tmp_path):
    path = tmp_path / "history" / "store.npz"
    assert load_history(path).size == 0
    append_history(path, [[1, 2, 3]], max_tokens=10)
    append_history(path, [[4, 5], [6, 7, 8]], max_tokens=10)
    assert (
        load_history(path).tolist()
        == [1, 2, 3, SEPARATOR, 4, 5, SEPARATOR, 6, 7, 8, SEPARATOR][-7:]
    )
    append_history(path, [list(range(20, 26))], max_tokens=10)
    assert load_history(path).tolist() == [20, 21, 22, 23, 24, 25, SEPARATOR]
    # no temp file left
    assert sorted(p.name for p in path.parent.iterdir()) == ["store.npz", "store.npz.lock"]


def test_a_failed_write_leaves_the_old_store(tmp_path, monkeypatch):
    path = tmp_path / "store.npz"
    append_history(path, [[1, 2]])

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez_compressed", full_disk)
    with pytest.raises(OSError):
        append_history(path, [[3, 4]])
    assert load_history(path).tolist() == [1, 2, SEPARATOR]
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("content", [b"not a zip", None])
def test_a_bad_store_is_one_clear_error(tmp_path, content):
    path = tmp_path / "store.npz"
    if content is None:
        np.savez(path, tokens=np.array([[1, 2]]))  # two-dimensional
    else:
        path.write_bytes(content)
    with pytest.raises(HistoryError, match="is not a history store"):
        load_history(path)


def _append_many(path, writer, count):
    for i in range(count):
        append_history(path, [[writer, i]], max_tokens=10_000)


def test_concurrent_writers_do_not_corrupt_or_lose_outputs(tmp_path):
    path = tmp_path / "store.npz"
    context = multiprocessing.get_context("spawn")  # no fork of a process that has MLX threads
    writers = [context.Process(target=_append_many, args=(path, writer, 25)) for writer in (1, 2)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(timeout=120)
        assert process.exitcode == 0
    outputs = np.split(load_history(path), np.flatnonzero(load_history(path) == SEPARATOR) + 1)[:-1]
    pairs = [tuple(output[:-1].tolist()) for output in outputs]
    assert sorted(pairs) == sorted((writer, i) for writer in (1, 2) for i in range(25))
    for writer in (1, 2):  # each writer's outputs in its own order
        assert [i for w, i in pairs if w == writer] == list(range(25))


@pytest.mark.parametrize("kwargs", [{"max_history_tokens": 0}, {"history": [1, -2]}])
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        HistoryLookupSource(**kwargs)


def test_plain_lookup_never_imports_history_lookup():
    """The store's code is opt-in: importing prompt_lookup, or building plain lookup from the
    CLI's flags, leaves it out (in a fresh interpreter, apart from this suite's imports)."""
    script = (
        "import sys, argparse, prompt_lookup, cli.sources\n"
        "args = argparse.Namespace(ngram_max=3, ngram_min=1, no_adaptive=False, num_draft=None,"
        " lookup_history=None)\n"
        "cli.sources.lookup_maker(args, [])()\n"
        "print('prompt_lookup.history' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.mark.slow
def test_cli_flag_end_to_end(tmp_path):
    store = tmp_path / "store.npz"
    command = [
        sys.executable,
        str(ROOT / "main.py"),
        "--prompt",
        "Name three colours.",
        "--max-tokens",
        "24",
        "--json",
        "--lookup-history",
        str(store),
    ]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    first = json.loads(
        subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
    )
    assert load_history(store).tolist() == first["tokens"] + [SEPARATOR]
    second = json.loads(
        subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
    )
    assert second["tokens"] == first["tokens"]
    # The same request again: its first answer is in the store, so nearly every token is drafted.
    assert second["draft_sources"]["history_lookup"]["accepted"] >= len(second["tokens"]) - 4
    # (that drafts keep the output: the property tests above)
    bad = tmp_path / "bad.npz"
    bad.write_text("garbage")
    failed = subprocess.run(
        command[:-1] + [str(bad)], check=False, capture_output=True, text=True, env=env
    )
    assert failed.returncode == 1
    assert failed.stderr.startswith("error: ") and failed.stderr.count("\n") == 1


@settings(max_examples=25, deadline=None)
@given(
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
    outputs=st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=20), max_size=3),
    max_tokens=st.integers(1, 40),
)
def test_the_replay_study_counts_the_loops_passes(prompt, outputs, max_tokens):
    """benchmarks/history_replay.py replays logged greedy outputs instead of decoding: it must
    count exactly the passes and drafts the loop takes with the same source."""
    from benchmarks.history_replay import replay

    answer = plain(prompt, max_tokens)
    for source in (PromptLookupSource(), HistoryLookupSource(join_outputs(outputs + [answer[:5]]))):
        stats = DecodingStats()
        # The replay prices passes at the cost model's prior; a clock that stands still keeps the
        # loop there too.
        list(
            generate_step(
                prompt,
                MODEL,
                draft_sources=[source],
                max_tokens=max_tokens,
                stats=stats,
                eos_token_ids=(),
                pass_cost=PassCost(clock=lambda: 0.0),
            )
        )
        replayed = replay(source, prompt, answer, max_tokens)
        assert replayed["passes"] == stats.target_forward_passes
        assert replayed["drafted"] == stats.draft_proposed


def test_copies_from_the_store_and_from_the_answer_keep_separate_estimates():
    store = [7, 8, 9, 10, 11]
    source = HistoryLookupSource(store)
    source.reset()
    from_store, from_answer = (2, True), (2, False)
    assert source.match_kind(2, 0) == from_store
    # from the generation; long counts as ngram_max
    assert source.match_kind(9, len(store) + 3) == (3, False)
    # the prior
    assert source.draft_length(from_store) == source.draft_length(from_answer) == source.num_draft
    tokens = [1, 2, 7, 8]  # "7 8" occurs only in the store
    for _ in range(3):  # the store's copies are rejected
        draft = source.propose(tokens, 8)
        assert draft.tokens[0] == 9 and draft.expected_speedup == source.expected_speedup(
            from_store, len(draft.tokens)
        )
        source.update(tokens, len(draft.tokens), 0)
    assert (
        0 < source.draft_length(from_store) < source.draft_length(from_answer) == source.num_draft
    )
    # A 2-gram of the answer itself ("5 6", after 0 there and 4 here) is still copied at full
    # length.
    tokens += [0, 5, 6, *range(20, 30), 4, 5, 6]
    draft = source.propose(tokens, 8)
    assert draft.tokens == list(range(20, 28))
    assert (
        draft.expected_speedup
        == source.expected_speedup(from_answer, 8)
        > source.expected_speedup(from_store, 8)
    )


def test_a_draft_says_what_it_expects_and_longer_agreement_expects_more():
    source = PromptLookupSource()
    tokens = []
    for ngram, num_accepted in ((1, 0), (2, 1), (3, 4)):  # a = 0, 0.5 and 0.8
        end_with_a_match(tokens, ngram)
        target_accepts(source, tokens, num_accepted)
    assert source.expected_speedup(3, 4) > source.expected_speedup(2, 1) > 1.0
    # a long copy of a poor match costs more than it gives
    assert source.expected_speedup(1, 8) < 1.0
    draft = source.propose(tokens, 8)  # after the 3-gram match
    assert draft.expected_speedup == source.expected_speedup(3, len(draft.tokens))
    assert PromptLookupSource(adaptive=False).propose(tokens, 8).expected_speedup is None


@pytest.mark.slow
def test_the_head_ships_a_seed_that_is_read_but_never_written(tmp_path):
    """``--draft-head --lookup-history PATH``: the store starts with the seed shipped with the
    head, and the run appends its output to PATH only."""
    import hashlib

    import main

    seed = ROOT / "draft_head" / "heads" / "smollm2-135m" / "history.npz"
    seed_tokens = load_history(seed)
    assert seed_tokens.size > 10_000 and seed_tokens[-1] == SEPARATOR
    before = hashlib.sha256(seed.read_bytes()).hexdigest()
    store = tmp_path / "fresh.npz"
    args = main.build_parser().parse_args(
        [
            "--draft-head",
            "--lookup-history",
            str(store),
            "--max-tokens",
            "12",
            "--json",
            "--prompt",
            "Name three colours.",
        ]
    )
    main.validate(args)
    _, _, _, kwargs = main.build_run(args)
    source = kwargs["draft_sources"][0]
    assert (
        isinstance(source, HistoryLookupSource) and source.history.tolist() == seed_tokens.tolist()
    )
    result = main.run(args)
    assert load_history(store).tolist() == result.tokens + [SEPARATOR]
    assert hashlib.sha256(seed.read_bytes()).hexdigest() == before
