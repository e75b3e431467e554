"""The byte DFA must agree with `re.fullmatch(pattern, text, re.ASCII)` on UTF-8 encoded text."""

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from constrained.regex_dfa import RegexError, compile_regex, utf8_sequences

HAND_WRITTEN = {
    "email": (
        r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}",
        [
            "a@b.co",
            "first.last+tag@mail-server.example.org",
            "a@b.c",
            "@b.co",
            "a@@b.co",
            "a@b.c0m",
        ],
    ),
    "phone": (
        r"\(\d{3}\) \d{3}-\d{4}",
        ["(555) 123-4567", "555-123-4567", "(555)123-4567", "(5555) 123-4567"],
    ),
    "date": (r"\d{4}-\d{2}-\d{2}", ["2024-02-29", "2024-2-29", "24-02-29", "2024-02-29\n"]),
    "time": (r"\d{2}:\d{2}(:\d{2})?", ["09:30", "09:30:15", "9:30", "09:30:", "09:30:15:00"]),
    "ipv4": (
        r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)",
        ["192.168.0.1", "255.255.255.255", "256.1.1.1", "1.2.3", "01.2.3.4", "001.2.3.4"],
    ),
    "url": (
        r"https?://[a-z0-9.-]+\.[a-z]{2,}(/[a-zA-Z0-9._~-]*)*",
        [
            "https://example.com",
            "http://a.io/x/y_z/",
            "ftp://a.io",
            "https://example.c",
            "https://ex.com/a b",
        ],
    ),
    "ssn": (r"\d{3}-\d{2}-\d{4}", ["123-45-6789", "123-456-789", "１２３-45-6789"]),
    "json": (
        r'\{"name": "[a-zA-Z ]{1,20}", "age": \d{1,3}\}',
        [
            '{"name": "Ada Lovelace", "age": 36}',
            '{"name": "", "age": 36}',
            '{"name": "Ada", "age": 1000}',
        ],
    ),
    "lazy": (r"<.+?>(a*?b+?)??c{1,2}?", ["<x>c", "<x>>abbcc", "<>c", "<x>ac"]),
    "up_to": (r"a{,3}b{2,}c{,}", ["", "aaabb", "aaaabb", "abbbbccc", "ab"]),
    "anchors": (r"^(yes|no)$", ["yes", "no", "yesno", "yes\n", "^yes$"]),
    "literal_braces": (r"a{x}b{}c{1,2,3}", ["a{x}b{}c{1,2,3}", "axbc"]),
    "non_ascii": (r"café|日本", ["café", "日本", "cafe", "日", "日本本"]),
    "emoji": (r"😀+ [👍-👏]?", ["😀 ", "😀😀 👍", "😀 👏", "😀 👐", " "]),
    "dot": (r".{2}", ["ab", "é日", "😀😀", "a\n", "\r\t", "abc"]),
    "negated": (r"[^a\d]+\D\W\S", ["bbé!x", "日本日 😀", "a__ x", "b9  x"]),
    "classes": (r"[\w.-]+[\s\d]*[]a-]", ["x.y-z 9]", "x-", "xa", "x\x0b\x0c1]"]),
    "escapes": (r"\x41\u00e9\t\n\.\*\\\[", ["Aé\t\n.*\\[", "Aé\t\n.*\\]"]),
    "empty": (r"(|a)(?:)", ["", "a", "aa"]),
}
NO_SURROGATES = st.characters(exclude_categories=["Cs"])
EXTRA_CHARS = ["a", "b", "0", " ", "\n", "é", "日", "😀", "-", "."]


def assert_agrees_with_re(pattern, dfa, text):
    expected = re.fullmatch(pattern, text, re.ASCII) is not None
    assert dfa.matches(text.encode()) == expected, (pattern, text)


def text_near(pattern):
    """Text made of the pattern's own characters plus a few others, so matches are likely."""
    alphabet = (
        st.sampled_from(sorted(set(pattern) - set("\\[](){}") | set(EXTRA_CHARS))) | NO_SURROGATES
    )
    return st.text(alphabet, max_size=12)


def matching_text(pattern):
    return st.from_regex(re.compile(pattern, re.ASCII), fullmatch=True).filter(
        lambda text: not any(0xD800 <= ord(char) <= 0xDFFF for char in text)
    )


@pytest.mark.parametrize("name", HAND_WRITTEN)
def test_hand_written_examples(name):
    pattern, texts = HAND_WRITTEN[name]
    dfa = compile_regex(pattern)
    for text in texts:
        assert_agrees_with_re(pattern, dfa, text)


@pytest.mark.parametrize("name", HAND_WRITTEN)
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
@given(data=st.data())
def test_hand_written_fuzzed(name, data):
    pattern, _ = HAND_WRITTEN[name]
    dfa = compile_regex(pattern)
    assert_agrees_with_re(pattern, dfa, data.draw(matching_text(pattern)))
    assert_agrees_with_re(pattern, dfa, data.draw(text_near(pattern)))


# Random regexes, rendered from small syntax trees. Each piece is valid on its own and stays valid
# when concatenated, so every rendered pattern is one `re` accepts.
LITERALS = ["a", "b", "0", " ", "é", "日", "😀", r"\.", r"\(", r"\n", r"\x41", "-", r"\{", "}"]
CLASS_ITEMS = [
    "a",
    "b-d",
    "0-5",
    r"\d",
    r"\w",
    r"\s",
    r"\S",
    "é",
    "à-ÿ",
    "Ѐ-ӿ",
    r"\-",
    r"\]",
    "😀",
    ".",
]
QUANTIFIERS = ["*", "+", "?", "{2}", "{0,2}", "{1,}", "{,2}", "*?", "+?", "??", "{1,3}?"]
ATOMS = st.one_of(
    st.sampled_from(LITERALS + [".", r"\d", r"\w", r"\s", r"\D", r"\W", r"\S"]),
    st.tuples(
        st.sampled_from(["[", "[^"]), st.lists(st.sampled_from(CLASS_ITEMS), min_size=1, max_size=4)
    ).map(lambda parts: parts[0] + "".join(parts[1]) + "]"),
)


def extend(children):
    return st.one_of(
        st.lists(children, min_size=2, max_size=3).map("".join),
        st.lists(children | st.just(""), min_size=2, max_size=3).map(
            lambda options: "(" + "|".join(options) + ")"
        ),
        children.map(lambda child: f"(?:{child})"),
        st.tuples(children, st.sampled_from(QUANTIFIERS)).map(
            lambda pair: f"(?:{pair[0]}){pair[1]}"
        ),
    )


REGEXES = st.lists(st.recursive(ATOMS, extend, max_leaves=8), min_size=1, max_size=2).map("|".join)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
@given(data=st.data())
def test_random_regexes_agree_with_re(data):
    pattern = data.draw(REGEXES, label="pattern")
    try:
        dfa = compile_regex(pattern)
    except RegexError as error:
        assert "matches no string" in str(error)
        for text in data.draw(st.lists(text_near(pattern), max_size=5)):
            assert re.fullmatch(pattern, text, re.ASCII) is None
        return
    assert_agrees_with_re(pattern, dfa, data.draw(matching_text(pattern), label="match"))
    for text in data.draw(st.lists(text_near(pattern), min_size=1, max_size=5), label="texts"):
        assert_agrees_with_re(pattern, dfa, text)


def test_dot_accepts_exactly_valid_utf8_characters():
    dfa = compile_regex(".")
    # The first and last code point of each UTF-8 length, and both sides of the surrogate gap.
    for text in [
        "a",
        "\x7f",
        "\x80",
        "é",
        "\u07ff",
        "\u0800",
        "日",
        "\ud7ff",
        "\ue000",
        "\uffff",
        "😀",
        "\U0010ffff",
    ]:
        assert dfa.matches(text.encode()), repr(text)
    # Newline, lone continuation, invalid byte, overlong encodings, a surrogate, past U+10FFFF,
    # truncated.
    invalid = [
        b"\n",
        b"\x80",
        b"\xff",
        b"\xc0\x80",
        b"\xe0\x80\x80",
        b"\xed\xa0\x80",
        b"\xf4\x90\x80\x80",
        b"\xe6\x97",
    ]
    for data in invalid:
        assert not dfa.matches(data), data


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 0x10FFFF), st.integers(0, 0x3000), st.integers(0, 0x10FFFF))
def test_utf8_sequences_cover_the_range_exactly(lo, width, probe):
    hi = min(lo + width, 0x10FFFF)
    sequences = utf8_sequences(lo, hi)
    valid = [code for code in range(lo, hi + 1) if not 0xD800 <= code <= 0xDFFF]
    covered = 0
    for sequence in sequences:
        count = 1
        for byte_lo, byte_hi in sequence:
            count *= byte_hi - byte_lo + 1
        covered += count
    assert covered == len(valid)  # no encoding is counted twice or made up ...
    for code in [lo, hi, probe, *valid[:: max(1, len(valid) // 50)]]:
        encoded = chr(code).encode("utf-8", "surrogatepass")
        inside = any(
            len(seq) == len(encoded) and all(a <= b <= z for (a, z), b in zip(seq, encoded))
            for seq in sequences
        )
        # ... and each lands in place
        assert inside == (lo <= code <= hi and not 0xD800 <= code <= 0xDFFF)


@pytest.mark.parametrize(
    "pattern, message",
    [
        ("(abc", "unbalanced parenthesis at position 0"),
        ("abc)", "unbalanced parenthesis at position 3"),
        ("a(b(c)", "unbalanced parenthesis at position 1"),
        ("a{3,1}", "min repeat greater than max repeat at position 2"),
        ("[z-a]", "bad character range z-a at position 1"),
        (r"[a-\d]", r"bad character range a-\d at position 1"),
        ("*a", "nothing to repeat at position 0"),
        ("a|+", "nothing to repeat at position 2"),
        ("(?:{2})", "nothing to repeat at position 3"),
        ("abc\\", "bad escape (end of pattern) at position 3"),
        (r"a\q", r"bad escape \q at position 1"),
        (r"\x4g", r"incomplete escape \x4g at position 0"),
        ("[abc", "unterminated character set at position 0"),
        ("[]", "unterminated character set at position 0"),
        ("a**", "multiple repeat at position 2"),
        ("a{2}{3}", "multiple repeat at position 4"),
        ("a*+", "possessive quantifiers are not supported at position 2"),
        ("a(?=b)", "lookahead is not supported at position 1"),
        ("a(?!b)", "lookahead is not supported at position 1"),
        ("(?<=a)b", "lookbehind is not supported at position 0"),
        (r"(a)\1", "backreferences and octal escapes are not supported at position 3"),
        ("(?P<x>a)(?P=x)", "backreferences are not supported at position 8"),
        (r"\bword\b", r"anchor \b is not supported at position 0"),
        ("(?i)a", "unsupported group syntax (?i at position 0"),
        (
            "a^b",
            "anchor ^ is only supported at the start (^) or end ($) of the pattern at position 1",
        ),
        (
            "(a$)",
            "anchor $ is only supported at the start (^) or end ($) of the pattern at position 2",
        ),
    ],
)
def test_errors_name_the_problem_and_position(pattern, message):
    with pytest.raises(RegexError) as caught:
        compile_regex(pattern)
    assert str(caught.value) == message


@pytest.mark.parametrize("pattern", [r"[^\s\S]", r"a[^\d\D]b", r"[^\x00-\U0010ffff]"])
def test_empty_language_is_an_error(pattern):
    with pytest.raises(RegexError, match="the regex matches no string"):
        compile_regex(pattern)


def test_state_cap():
    # The last 10 letters must be remembered: 2**11 subsets.
    with pytest.raises(RegexError, match="regex too large: more than 1000 DFA states"):
        compile_regex("(a|b)*a(a|b){10}", max_states=1000)
    assert compile_regex("(a|b)*a(a|b){10}", max_states=3000).num_states == 2**11


def test_named_groups_are_plain_groups():
    assert compile_regex("(?P<year>\\d{4})-(?P<month>\\d\\d)").matches(b"2024-02")


def test_dfa_is_minimal():
    assert compile_regex("(a|b)*abb").num_states == 4
    # Start, accept, and the 7 ways of being inside a multi-byte character.
    assert compile_regex(".+").num_states == 9
    assert compile_regex("(a|b|ab)*").num_states == 1


def test_forced_bytes():
    phone = compile_regex(r"\(\d{3}\) \d{3}-\d{4}")
    assert phone.forced_bytes(phone.start) == b"("
    json_shape = compile_regex(r'\{"name": "[a-zA-Z ]{1,20}", "age": \d{1,3}\}')
    assert json_shape.forced_bytes(json_shape.start) == b'{"name": "'
    optional_tail = compile_regex("ab(cd)?")
    assert optional_tail.forced_bytes(optional_tail.start) == b"ab"  # stops at an accepting state
    choice = compile_regex("a|b")
    assert choice.forced_bytes(choice.start) == b""
    # 日 and 旦 share their first two bytes: the forced run ends inside the character.
    same_prefix = compile_regex("[日旦]")
    assert same_prefix.forced_bytes(same_prefix.start) == "日".encode()[:2]
    date = compile_regex(r"\d{4}-\d{2}")
    assert date.forced_bytes(date.step(date.start, b"2024")) == b"-"
