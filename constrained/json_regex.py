"""Regexes for JSON leaves: literals, strings, formats, number ranges and `pattern` (used by
`json_schema.py`).

Every regex here matches only JSON text whose value satisfies the constraint it was built for; where
the exact set is not a regular language of reasonable size (leap days, long hostnames) it is a
subset.
"""

import json
import math
import re

from constrained.regex_parse import (
    MAX_CODEPOINT,
    Alt,
    Chars,
    Concat,
    RegexError,
    Repeat,
    complement_ranges,
    normalize_ranges,
    parse_regex,
)

# groups nested in a `pattern`: the rewrite below walks the tree recursively
PATTERN_MAX_DEPTH = 100

# One character of a JSON string as written in the JSON text: a raw character other than `"`, `\`
# and controls, a short escape, or a \u escape outside the surrogates (a lone surrogate is not a
# character).
STRING_CHAR = (
    r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]'
    r"|\\u(?:[0-9a-cA-CeEfF][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))"
)
STRING = f'"{STRING_CHAR}*"'
# In strings of bounded length each position costs DFA states; \u escapes (5 states each) are left
# out.
BOUNDED_STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt])'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
BOOLEAN = "(?:true|false)"
NULL = "null"

_YEAR = "[1-9][0-9]{3}"  # year 0 is not a Python date
_DAY_IN_MONTH = (
    r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    r"|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)  # February 29 is left out: leap years are not regular enough
_TIME = (
    r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?"  # hh:mm:ss and a fraction
    r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"  # the offset
)
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,18}[a-zA-Z0-9])?"  # labels of <= 20 characters, <= 4 labels
_HEX = "[0-9a-fA-F]"
FORMATS = {
    "date": f"{_YEAR}-{_DAY_IN_MONTH}",
    "time": _TIME,
    "date-time": f"{_YEAR}-{_DAY_IN_MONTH}T{_TIME}",
    "uuid": f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}",
    "email": rf"[a-zA-Z0-9._%+-]{{1,32}}@{_LABEL}(?:\.{_LABEL}){{1,3}}",
    "hostname": rf"{_LABEL}(?:\.{_LABEL}){{0,3}}",
    "ipv4": rf"{_OCTET}(?:\.{_OCTET}){{3}}",
    "ipv6": f"{_HEX}{{1,4}}(?::{_HEX}{{1,4}}){{7}}",  # the full form only
    "uri": rf"https?://{_LABEL}(?:\.{_LABEL}){{0,3}}(?:/[a-zA-Z0-9._~-]*)*",
}
FORMATS.update(
    {
        "uri-reference": FORMATS["uri"],
        "iri": FORMATS["uri"],
        "iri-reference": FORMATS["uri"],
        "idn-email": FORMATS["email"],
        "idn-hostname": FORMATS["hostname"],
    }
)


def literal(value) -> str:
    """A regex matching exactly the compact JSON text of `value` (keys in their order)."""
    return re.escape(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def bounded_string(min_length: int, max_length) -> str:
    """A JSON string of min_length..max_length characters (max_length None: unbounded)."""
    if max_length is None:
        return f'"{STRING_CHAR}{{{min_length},}}"'
    return f'"{BOUNDED_STRING_CHAR}{{{min_length},{max_length}}}"'


def _digit_class(low: int, high: int) -> str:
    return str(low) if low == high else f"[{low}-{high}]"


def _any_digits(count: int) -> str:
    return "" if count == 0 else "[0-9]" if count == 1 else f"[0-9]{{{count}}}"


def _digits_range(lo: str, hi: str) -> str:
    """Digit strings of equal length from lo to hi (inclusive), e.g. ("120", "349"); size linear in
    digits."""
    if lo == hi:
        return lo
    split = next(index for index, (a, b) in enumerate(zip(lo, hi)) if a != b)
    prefix, low, high, tail = lo[:split], int(lo[split]), int(hi[split]), len(lo) - split - 1
    # lo's digit with a tail >= lo's; the digits between with any tail; hi's digit with a tail <=
    # hi's. A tail of all zeros (or nines) takes any tail, so that digit joins the middle.
    first = low if not lo[split + 1 :].strip("0") else low + 1
    last = high if not hi[split + 1 :].strip("9") else high - 1
    options = [f"{low}{_digits_range(lo[split + 1 :], '9' * tail)}"] if first > low else []
    if first <= last:
        options.append(_digit_class(first, last) + _any_digits(tail))
    if last < high:
        options.append(f"{high}{_digits_range('0' * tail, hi[split + 1 :])}")
    return prefix + (options[0] if len(options) == 1 else "(?:" + "|".join(options) + ")")


def _natural_range(lo: int, hi) -> list:
    """Regex options for the naturals lo..hi written without leading zeros (hi None: unbounded)."""
    options, length = [], len(str(lo))
    while hi is None or length <= len(str(hi)):
        first = max(lo, 10 ** (length - 1) if length > 1 else 0)
        last = 10**length - 1 if hi is None else min(hi, 10**length - 1)
        if hi is None and first == 10 ** (length - 1) and length > 1:
            options.append(f"[1-9][0-9]{{{length - 1},}}")  # every longer number too
            break
        if first <= last:
            options.append(_digits_range(str(first), str(last)))
        length += 1
    return options


def integer_range(lo, hi) -> str:
    """A regex for the integers lo..hi (either may be None for unbounded); None if the range is
    empty."""
    if lo is not None and hi is not None and lo > hi:
        return None
    options = (
        _natural_range(max(lo, 0) if lo is not None else 0, hi) if hi is None or hi >= 0 else []
    )
    if lo is None or lo < 0:
        # Negative numbers: "-" and the magnitude -hi..-lo, never "-0".
        magnitudes = _natural_range(
            max(1, -hi if hi is not None else 1), None if lo is None else -lo
        )
        options.append("-(?:" + "|".join(magnitudes) + ")")
    return "(?:" + "|".join(options) + ")"


def whole_bounds(lo, lo_exclusive: bool, hi, hi_exclusive: bool) -> tuple:
    """The smallest and largest integers in the range (None for an unbounded side)."""
    whole_lo = None if lo is None else (math.floor(lo) + 1 if lo_exclusive else math.ceil(lo))
    whole_hi = None if hi is None else (math.ceil(hi) - 1 if hi_exclusive else math.floor(hi))
    return whole_lo, whole_hi


def number_range(lo, lo_exclusive: bool, hi, hi_exclusive: bool) -> str:
    """A regex for JSON numbers in the range, bounded on the integer part; None if none fits. A
    fraction is allowed only after an integer part I whose whole interval of values fits: [I, I+1)
    for "I.ddd" and (-I-1, -I] for "-I.ddd". Exponents are left out; floor and ceil keep the bounds
    exact."""
    whole_lo, whole_hi = whole_bounds(lo, lo_exclusive, hi, hi_exclusive)
    options = [integer_range(whole_lo, whole_hi)]
    # I.ddd (I >= 0) needs lo <= I (lo < I if exclusive) and I + 1 <= hi; -I.ddd needs lo <= -I - 1
    # and -I <= hi (-I < hi if exclusive).
    positive = (0 if lo is None else max(whole_lo, 0), None if hi is None else math.floor(hi) - 1)
    negative = (0 if hi is None else max(-whole_hi, 0), None if lo is None else math.floor(-lo) - 1)
    for sign, (low, high) in (("", positive), ("-", negative)):
        if high is None or low <= high:
            options.append(f"{sign}(?:{'|'.join(_natural_range(low, high))})\\.[0-9]+")
    options = [option for option in options if option is not None]
    return "(?:" + "|".join(options) + ")" if options else None


_JSON_UNSAFE = ((0x00, 0x1F), (ord('"'), ord('"')), (ord("\\"), ord("\\")))


def _without_unsafe(ranges, ascii_only: bool) -> tuple:
    """Remove the characters a JSON string must escape (so the text is the value), optionally
    non-ASCII."""
    removed = [*_JSON_UNSAFE, *([(0x80, MAX_CODEPOINT)] if ascii_only else [])]
    return complement_ranges(normalize_ranges([*complement_ranges(ranges), *removed]))


def _to_regex(node, ascii_only: bool) -> str:
    """Write a syntax tree back as regex text, keeping only JSON-safe characters."""
    if isinstance(node, Chars):
        ranges = _without_unsafe(node.ranges, ascii_only)
        if not ranges:
            return "[^\\x00-\\U0010ffff]"  # matches nothing
        return (
            "["
            + "".join(
                f"\\U{lo:08x}" if lo == hi else f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in ranges
            )
            + "]"
        )
    if isinstance(node, Concat):
        return "".join(_to_regex(item, ascii_only) for item in node.items)
    if isinstance(node, Alt):
        return "(?:" + "|".join(_to_regex(option, ascii_only) for option in node.options) + ")"
    bounds = f"{{{node.min_count},{'' if node.max_count is None else node.max_count}}}"
    return f"(?:{_to_regex(node.item, ascii_only)}){bounds}"


def _length_range(node) -> tuple:
    """(fewest, most) characters a tree matches; most is None when unbounded."""
    if isinstance(node, Chars):
        return 1, 1
    if isinstance(node, Repeat):
        low, high = _length_range(node.item)
        most = None if high is None or node.max_count is None else high * node.max_count
        return low * node.min_count, (0 if node.max_count == 0 else most)
    ranges = [
        _length_range(child) for child in (node.items if isinstance(node, Concat) else node.options)
    ]
    highs = [high for _, high in ranges]
    if isinstance(node, Concat):
        return sum(low for low, _ in ranges), None if None in highs else sum(highs)
    return min((low for low, _ in ranges), default=0), None if None in highs else max(
        highs, default=0
    )


def _cap_repeats(node, extra: int):
    """The tree with every unbounded repeat {m,} turned into {m,m+extra}."""
    if isinstance(node, Chars):
        return node
    if isinstance(node, Repeat):
        most = node.min_count + extra if node.max_count is None else node.max_count
        return Repeat(_cap_repeats(node.item, extra), node.min_count, most)
    if isinstance(node, Concat):
        return Concat(tuple(_cap_repeats(item, extra) for item in node.items))
    return Alt(tuple(_cap_repeats(option, extra) for option in node.options))


def _within_length(tree, min_length: int, max_length):
    """`tree` limited to strings of at most max_length characters, or None if that needs more than
    capping."""
    fewest, most = _length_range(tree)
    if fewest < min_length:
        return None  # a minimum would need an intersection; refused
    if max_length is None or (most is not None and most <= max_length):
        return tree
    # The largest cap on unbounded repeats that keeps every match short enough (a subset of the
    # pattern).
    low, high = -1, max_length
    while low < high:
        middle = (low + high + 1) // 2
        capped_most = _length_range(_cap_repeats(tree, middle))[1]
        low, high = (
            (middle, high)
            if capped_most is not None and capped_most <= max_length
            else (low, middle - 1)
        )
    return _cap_repeats(tree, low) if low >= 0 else None


def pattern_string(pattern: str, min_length: int = 0, max_length=None) -> str:
    """A JSON string regex for `pattern` (JSON Schema: `re.search` on the decoded string).
    Unanchored ends get `.*`. With minLength/maxLength: served when every match of the pattern is
    long enough, and unbounded repeats are capped so that every match is short enough; else
    RegexError. The characters JSON must escape are removed from the pattern's sets, so the text
    between the quotes is the value itself. Our dialect reads \\D \\W \\S as ASCII (re.ASCII) while
    a validator reads them as Unicode; patterns using them keep to ASCII so they stay a subset.
    Raises RegexError for what our parser does not support."""
    anchored_start, body = pattern.startswith("^"), pattern.removeprefix("^")
    anchored_end = body.endswith("$") and not body.endswith("\\$")
    body = body[:-1] if anchored_end else body
    ascii_only = bool(re.search(r"\\[DWS]", body))
    tree = parse_regex(body, max_depth=PATTERN_MAX_DEPTH)
    anything = Repeat(Chars(((0, MAX_CODEPOINT),)), 0, None)
    parts = ([] if anchored_start else [anything]) + [tree] + ([] if anchored_end else [anything])
    limited = _within_length(Concat(tuple(parts)), min_length, max_length)
    if limited is None:
        raise RegexError(f"cannot combine it with minLength {min_length} / maxLength {max_length}")
    return '"' + _to_regex(limited, ascii_only) + '"'
