"""Token masks against a brute-force walk of every token, on SmolLM2's real 49k vocabulary."""

import random

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models

from constrained.regex_dfa import RegexError, compile_regex
from constrained.token_index import TokenIndex, load_or_build_index, token_byte_strings

VOCAB_SIZE = 49152
EOS = 2  # <|im_end|>
REGEXES = [
    r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}",
    r"\(\d{3}\) \d{3}-\d{4}",
    r"\d{4}-\d{2}-\d{2}",
    r"\d{2}:\d{2}(:\d{2})?",
    r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)",
    r"https?://[a-z0-9.-]+\.[a-z]{2,}(/[a-zA-Z0-9._~-]*)*",
    r"\d{3}-\d{2}-\d{4}",
    r'\{"name": "[a-zA-Z ]{1,20}", "age": \d{1,3}\}',
    r"[^a]+",
    r"café|日本",
    r"(.|\n){0,5}",
    r" ?(yes|no|maybe)\.",
]


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's tokenizer as `conversion.gguf_tokenizer` builds it for the embedded model (a HF
    fast tokenizer)."""
    import mlx.core as mx

    from loading.conversion import gguf_tokenizer
    from loading.load import embedded_gguf

    _, metadata = mx.load(str(embedded_gguf()), return_metadata=True)
    return gguf_tokenizer(metadata)


@pytest.fixture(scope="module")
def token_bytes(tokenizer):
    return token_byte_strings(tokenizer, VOCAB_SIZE)


@pytest.fixture(scope="module")
def indexes(token_bytes):
    return {
        pattern: TokenIndex.build(compile_regex(pattern), token_bytes, [EOS]) for pattern in REGEXES
    }


def brute_force_next_states(dfa, state, token_bytes):
    """The oracle: walk each token's bytes through the DFA in plain Python."""
    transitions, byte_class = dfa.transitions.tolist(), dfa.byte_class.tolist()
    result = []
    for token in token_bytes:
        current = state if token else -1
        for byte in token or b"":
            current = transitions[current][byte_class[byte]]
            if current < 0:
                break
        result.append(current)
    return np.array(result)


@pytest.mark.parametrize(
    "text", ["Hello, world!", " 日本語 😀 éé\n\ttabs", "2024-02-29 12:30", "  two  spaces "]
)
def test_token_bytes_concatenate_to_the_text(tokenizer, token_bytes, text):
    ids = tokenizer.encode(text)
    assert b"".join(token_bytes[i] for i in ids) == text.encode()


def test_token_bytes_of_special_tokens_and_padding(tokenizer, token_bytes):
    assert token_bytes[EOS] is None and token_bytes[0] is None  # <|im_end|>, <|endoftext|>
    assert token_bytes[tokenizer.convert_tokens_to_ids("Ġthe")] == b" the"
    assert sum(token is None for token in token_bytes) == 17  # the GGUF's control tokens
    # Single-byte tokens include lone UTF-8 continuation bytes, but a few bytes are not in the
    # vocabulary.
    single_bytes = {token[0] for token in token_bytes if token is not None and len(token) == 1}
    assert set(range(0x80, 0xC0)) <= single_bytes
    missing = {0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)}
    assert set(range(256)) - single_bytes == missing
    padded = token_byte_strings(tokenizer, VOCAB_SIZE + 64)
    assert padded[:VOCAB_SIZE] == token_bytes and padded[VOCAB_SIZE:] == [None] * 64


def test_token_bytes_through_wrappers(tokenizer, token_bytes):
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    assert token_byte_strings(tokenizer.backend_tokenizer, VOCAB_SIZE) == token_bytes
    assert token_byte_strings(TokenizerWrapper(tokenizer), VOCAB_SIZE) == token_bytes
    with pytest.raises(TypeError, match="expected a tokenizers.Tokenizer"):
        token_byte_strings("not a tokenizer", VOCAB_SIZE)


def test_token_bytes_of_a_sentencepiece_vocabulary():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x0A>": 3, "<0xE6>": 4, "▁hi": 5, "é": 6, "▁": 7}
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tokenizer.add_special_tokens(
        [AddedToken(text, special=True) for text in ["<unk>", "<s>", "</s>"]]
    )
    assert token_byte_strings(tokenizer, 9) == [
        None,
        None,
        None,
        b"\n",
        b"\xe6",
        b" hi",
        "é".encode(),
        b" ",
        None,
    ]


@pytest.mark.parametrize("pattern", REGEXES)
def test_masks_match_brute_force(indexes, token_bytes, pattern):
    index = indexes[pattern]
    spellable = np.array([token is not None for token in token_bytes])
    states = [index.start] + random.Random(pattern).sample(
        range(index.num_states), min(3, index.num_states)
    )
    for state in states:
        expected = brute_force_next_states(index.dfa, state, token_bytes)
        # These regexes never need a byte the vocabulary lacks, so no token is pruned.
        assert np.array_equal(index.row(state)[spellable], expected[spellable])
        mask = np.array(index.allowed_mask(state))
        assert np.array_equal(mask[spellable], expected[spellable] >= 0)
        assert not mask[~spellable & (np.arange(VOCAB_SIZE) != EOS)].any()
    assert np.array_equal(
        np.array(index.masks(states)), np.stack([index.row(s) for s in states]) >= 0
    )


@pytest.mark.parametrize("pattern", REGEXES)
def test_eos_allowed_exactly_in_accepting_states(indexes, pattern):
    index = indexes[pattern]
    for state in range(index.num_states):
        assert bool(index.allowed_mask(state)[EOS]) == index.is_accepting(state)
        assert index.next_state(state, EOS) == (state if index.is_accepting(state) else -1)


@pytest.mark.parametrize(
    "pattern, text",
    [("[^a]+", " 日本 😀 éé"), ("é+", "éééé"), ("(日本)+", "日本日本日本"), (".+", "😀👍🏽")],
)
def test_tokens_that_split_characters_walk_to_acceptance(tokenizer, token_bytes, pattern, text):
    index = TokenIndex.build(compile_regex(pattern), token_bytes, [EOS])
    state = index.start
    for token in tokenizer.encode(text):
        assert index.allowed_mask(state)[token].item()
        state = index.next_state(state, token)
    assert index.is_accepting(state)


def test_partial_character_tokens_only_where_the_character_is_allowed(token_bytes):
    lead_byte = token_bytes.index("日".encode()[:1])  # 日 = E6 97 A5, 本 = E6 9C AC
    middle_of_ri = token_bytes.index("日".encode()[1:2])
    ri = TokenIndex.build(compile_regex("日+"), token_bytes, [EOS])
    hon = TokenIndex.build(compile_regex("本+"), token_bytes, [EOS])
    e_acute = TokenIndex.build(compile_regex("é+"), token_bytes, [EOS])
    assert (
        ri.allowed_mask(ri.start)[lead_byte].item()
        and hon.allowed_mask(hon.start)[lead_byte].item()
    )
    assert not e_acute.allowed_mask(e_acute.start)[lead_byte].item()
    assert ri.allowed_mask(ri.next_state(ri.start, lead_byte))[middle_of_ri].item()
    assert not hon.allowed_mask(hon.next_state(hon.start, lead_byte))[middle_of_ri].item()
    # Nothing may end the text halfway through a character.
    assert not ri.is_accepting(ri.next_state(ri.start, lead_byte))
    # A lone continuation byte never starts a character.
    anything = TokenIndex.build(compile_regex("[^a]+"), token_bytes, [EOS])
    assert not anything.allowed_mask(anything.start)[middle_of_ri].item()


def test_tokens_into_unfinishable_states_are_pruned():
    # No "b" token: "a" would leave the text stuck, so only "ab" may start "ab|abc".
    token_bytes = [b"a", b"ab", b"c", None]
    index = TokenIndex.build(compile_regex("ab|abc"), token_bytes, [3])
    assert index.row(index.start).tolist() == [-1, index.next_state(index.start, 1), -1, -1]
    after_ab = index.next_state(index.start, 1)
    assert index.is_accepting(after_ab) and index.allowed_mask(after_ab).tolist() == [
        False,
        False,
        True,
        True,
    ]
    with pytest.raises(RegexError, match="the vocabulary cannot spell the regex from state 0"):
        TokenIndex.build(compile_regex("b+"), token_bytes, [3])


@pytest.mark.parametrize("pattern", [r"\x04+", "[\U00040000-\U0007ffff]"])
def test_regex_needing_missing_bytes_is_an_error(token_bytes, pattern):
    with pytest.raises(RegexError, match="the vocabulary cannot spell the regex from state 0"):
        TokenIndex.build(compile_regex(pattern), token_bytes, [EOS])


def test_forced_bytes_through_the_index(indexes):
    index = indexes[r'\{"name": "[a-zA-Z ]{1,20}", "age": \d{1,3}\}']
    assert index.dfa.forced_bytes(index.start) == b'{"name": "'


def test_cache_round_trip(tokenizer, tmp_path):
    pattern = r"\d{2}:\d{2}(:\d{2})?"
    built = load_or_build_index(pattern, tokenizer, VOCAB_SIZE, [EOS], cache_dir=tmp_path)
    (cached_file,) = tmp_path.glob("*.npz")
    loaded = load_or_build_index(pattern, tokenizer, VOCAB_SIZE, [EOS], cache_dir=tmp_path)
    for name in ["byte_class", "transitions", "accepting"]:
        assert np.array_equal(getattr(built.dfa, name), getattr(loaded.dfa, name))
    assert np.array_equal(built.finishable, loaded.finishable)
    assert all(np.array_equal(built.row(s), loaded.row(s)) for s in range(built.num_states))
    assert (loaded.start, loaded.eos_token_ids) == (built.start, built.eos_token_ids)
    assert np.array_equal(np.array(loaded.masks([0, 1])), np.array(built.masks([0, 1])))
    # A different EOS set or pattern is a different file; the first one is reused as is.
    load_or_build_index(pattern, tokenizer, VOCAB_SIZE, [EOS, 0], cache_dir=tmp_path)
    load_or_build_index(pattern + "?", tokenizer, VOCAB_SIZE, [EOS], cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.npz"))) == 3 and not list(tmp_path.glob("*.tmp"))
    assert cached_file.exists()


def test_cache_dir_respects_xdg(monkeypatch, tmp_path):
    from loading.store import cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "mlx-decoding"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert str(cache_dir()).endswith(".cache/mlx-decoding")


def test_no_cache_dir_keeps_the_index_in_memory(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    index = load_or_build_index(r"\d+", tokenizer, VOCAB_SIZE, [EOS])
    assert index.allowed_mask(index.start).any() and not any(tmp_path.iterdir())
