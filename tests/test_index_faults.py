"""The lazy token index: same masks as a dense index, bounded memory and disk, and a cache that
heals."""

import os
import re
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from constrained.regex_dfa import RegexError, compile_regex, states_reaching
from constrained.token_index import (
    TokenIndex,
    TokenTable,
    load_or_build_index,
    token_byte_strings,
    walk_tokens,
)
from tests.helpers import tiny_byte_tokenizer

TOKENIZER = tiny_byte_tokenizer()
VOCAB = len(TOKENIZER)
EOS = TOKENIZER.eos_token_id
TOKEN_BYTES = token_byte_strings(TOKENIZER, VOCAB)
# The same vocabulary without a few one-byte tokens: the up-front token-level check must run.
MISSING = {ord("b"), ord("1"), ord(":")}
GAPPY_BYTES = [
    None if token is not None and len(token) == 1 and token[0] in MISSING else token
    for token in TOKEN_BYTES
]


def dense_rows(dfa, token_bytes):
    """The dense index as it was: every state's row up front, pruned by token-level reachability."""
    rows = walk_tokens(dfa, TokenTable.build(token_bytes), range(dfa.num_states))
    rows[:, EOS] = np.where(dfa.accepting, np.arange(dfa.num_states), -1)
    sources, tokens = np.nonzero(rows >= 0)
    finishable = states_reaching(sources, rows[sources, tokens], dfa.accepting)
    rows[(rows >= 0) & ~finishable[np.maximum(rows, 0)]] = -1
    return rows, finishable


atoms = st.sampled_from(["a", "b", "1", ":", "[ab]", "[^a]", r"\d", ".", "é", "(ab|b1)", "日"])
regexes = st.recursive(
    atoms,
    lambda inner: st.one_of(
        st.tuples(inner, inner).map("".join),
        st.tuples(inner, inner).map(lambda p: f"(?:{p[0]}|{p[1]})"),
        st.tuples(inner, st.sampled_from(["*", "+", "?", "{2}", "{1,3}"])).map(
            lambda p: f"(?:{p[0]}){p[1]}"
        ),
    ),
    max_leaves=6,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pattern=regexes, gappy=st.booleans())
def test_lazy_rows_equal_the_dense_index(pattern, gappy):
    token_bytes = GAPPY_BYTES if gappy else TOKEN_BYTES
    dfa = compile_regex(pattern)
    rows, finishable = dense_rows(dfa, token_bytes)
    if not finishable[dfa.start]:
        with pytest.raises(RegexError, match="the vocabulary cannot spell the regex"):
            TokenIndex.build(dfa, token_bytes, [EOS])
        return
    # the smallest cache: rows get evicted
    index = TokenIndex.build(dfa, token_bytes, [EOS], row_cache_bytes=0)
    for state in list(range(dfa.num_states)) * 2:
        assert np.array_equal(index.row(state), rows[state]), (pattern, state)
    states = list(range(dfa.num_states))
    assert np.array_equal(np.array(index.masks(states)), rows >= 0)
    # A cached row is (V,) int32 next states and a (V,) bool mask: the cache holds max_cached_rows
    # at most.
    assert index.cached_bytes <= index.max_cached_rows * 5 * len(token_bytes)


def test_a_large_regex_is_cheap_until_visited(tmp_path):
    tic = time.perf_counter()
    index = load_or_build_index("a{9999}", TOKENIZER, VOCAB, [EOS], cache_dir=tmp_path)
    assert time.perf_counter() - tic < 10 and index.num_states == 10_000
    (cached,) = tmp_path.glob("*.npz")
    assert cached.stat().st_size < 1 << 20 and index.cached_bytes == 0
    state = index.start
    for _ in range(300):
        state = index.next_state(state, TOKENIZER.convert_tokens_to_ids("a"))
    assert index.cached_bytes <= index.max_cached_rows * 5 * VOCAB
    load_or_build_index("(a|b){1,500}", TOKENIZER, VOCAB, [EOS], cache_dir=tmp_path)
    assert sum(path.stat().st_size for path in tmp_path.glob("*.npz")) < 2 << 20


def test_past_the_state_limit_is_one_clear_error(tmp_path):
    with pytest.raises(RegexError, match="regex too large: more than 50000 DFA states"):
        load_or_build_index("[ab]*b[ab]{16}", TOKENIZER, VOCAB, [EOS], cache_dir=tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "wrong_key", "bad_arrays"])
def test_a_damaged_or_foreign_cache_file_is_rebuilt(tmp_path, damage):
    pattern, other = r"\d{2}-[ab]+", "(ab)+"
    load_or_build_index(other, TOKENIZER, VOCAB, [EOS], cache_dir=tmp_path / "other")
    index = load_or_build_index(pattern, TOKENIZER, VOCAB, [EOS], cache_dir=tmp_path)
    (path,) = tmp_path.glob("*.npz")
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "wrong_key":  # another regex's valid file copied over this one
        (foreign,) = (tmp_path / "other").glob("*.npz")
        path.write_bytes(foreign.read_bytes())
    else:
        arrays = dict(np.load(path))
        arrays["transitions"] = arrays["transitions"] + 1000
        np.savez(open(path, "wb"), **arrays)
    rebuilt = load_or_build_index(pattern, TOKENIZER, VOCAB, [EOS], cache_dir=tmp_path)
    assert np.array_equal(rebuilt.dfa.transitions, index.dfa.transitions)
    assert path.read_bytes() == data  # healed in place
    text = TOKENIZER.encode("12-abba")
    state = rebuilt.start
    for token in text:
        state = rebuilt.next_state(state, token)
    assert rebuilt.is_accepting(state) and re.fullmatch(pattern, "12-abba")


def test_an_unwritable_cache_only_warns(tmp_path, capfd):
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(0o500)
    try:
        if os.access(readonly, os.W_OK):
            pytest.skip("running as a user who can write anywhere (root)")
        index = load_or_build_index(
            r"\d+", TOKENIZER, VOCAB, [EOS], cache_dir=readonly / "regex-index"
        )
        assert index.next_state(index.start, TOKENIZER.convert_tokens_to_ids("7")) >= 0
        err = capfd.readouterr().err
        assert err.count("\n") == 1 and err.startswith(
            "warning: cannot write the regex index cache"
        )
    finally:
        readonly.chmod(0o700)


def test_an_unwritable_cache_file_path_only_warns(tmp_path, capfd):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    index = load_or_build_index(r"\d+", TOKENIZER, VOCAB, [EOS], cache_dir=blocker / "regex-index")
    assert index.num_states >= 1
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "warning: cannot write the regex index cache" in err
