"""Parse a regular expression (Python `re` syntax, `re.ASCII` classes) into a syntax tree.

The tree is four node types over code points: `Chars` (a set of code point intervals), `Concat`,
`Alt` and `Repeat`. Unsupported syntax (lookaround, backreferences, inline flags, ...) raises
`RegexError` with the position of the problem. `regex_dfa.py` compiles the tree to a byte DFA.
"""

from dataclasses import dataclass

MAX_CODEPOINT = 0x10FFFF


class RegexError(ValueError):
    """A regex that is malformed, unsupported, matches nothing, or is too large."""


@dataclass(frozen=True)
class Chars:
    ranges: tuple[tuple[int, int], ...]  # sorted, disjoint, inclusive code point intervals


@dataclass(frozen=True)
class Repeat:
    item: "Node"
    min_count: int
    max_count: int | None  # None: unbounded


@dataclass(frozen=True)
class Concat:
    items: tuple["Node", ...]


@dataclass(frozen=True)
class Alt:
    options: tuple["Node", ...]


Node = Chars | Repeat | Concat | Alt


def normalize_ranges(ranges):
    """Sort and merge overlapping or adjacent intervals."""
    merged = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def complement_ranges(ranges):
    """The code points outside sorted, disjoint intervals, as intervals."""
    gaps, next_lo = [], 0
    for lo, hi in ranges:
        if lo > next_lo:
            gaps.append((next_lo, lo - 1))
        next_lo = hi + 1
    if next_lo <= MAX_CODEPOINT:
        gaps.append((next_lo, MAX_CODEPOINT))
    return tuple(gaps)


# `re.ASCII` semantics: \d \w \s are ASCII only, so their negations include every non-ASCII
# character.
DIGIT = ((ord("0"), ord("9")),)
WORD = normalize_ranges(
    [(ord("0"), ord("9")), (ord("A"), ord("Z")), (ord("_"), ord("_")), (ord("a"), ord("z"))]
)
SPACE = ((ord("\t"), ord("\r")), (ord(" "), ord(" ")))
CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE}
# \D \W \S
CLASS_ESCAPES |= {name.upper(): complement_ranges(ranges) for name, ranges in CLASS_ESCAPES.items()}
CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}
HEX_ESCAPE_DIGITS = {"x": 2, "u": 4, "U": 8}
ANY_BUT_NEWLINE = complement_ranges(((ord("\n"), ord("\n")),))
UNSUPPORTED_GROUPS = {
    "?=": "lookahead is",
    "?!": "lookahead is",
    "?<=": "lookbehind is",
    "?<!": "lookbehind is",
    "?P=": "backreferences are",
    "?>": "atomic groups are",
    "?(": "conditional groups are",
    "?#": "comments are",
}


def _single_code(char_set):
    """The code point of a one-character set, or None (e.g. for \\d)."""
    (lo, hi), *rest = char_set
    return lo if lo == hi and not rest else None


class _Parser:
    """One pass over the pattern with a stack of open groups, so nesting costs no Python
    recursion."""

    def __init__(self, pattern, max_depth):
        self.pattern = pattern
        self.max_depth = max_depth
        self.pos = 0

    def error(self, message, pos):
        return RegexError(f"{message} at position {pos}")

    def peek(self):
        return self.pattern[self.pos] if self.pos < len(self.pattern) else ""

    def parse(self):
        # Under fullmatch a leading ^ (and a trailing $) changes nothing.
        if self.pattern.startswith("^"):
            self.pos = 1
        open_groups = []  # (position of "(", the enclosing group's alternatives)
        # of the innermost open group: the items of each, the last one still open
        alternatives = [[]]
        while True:
            char = self.peek()
            if char == "|":
                self.pos += 1
                alternatives.append([])
            elif char == ")":
                if not open_groups:
                    raise self.error("unbalanced parenthesis", self.pos)
                self.pos += 1
                group = _choice(alternatives)
                _, alternatives = open_groups.pop()
                alternatives[-1].append(self.parse_quantifier(group))
            elif char == "(":
                if self.max_depth is not None and len(open_groups) >= self.max_depth:
                    raise self.error(f"groups nested more than {self.max_depth} deep", self.pos)
                open_groups.append((self.pos, alternatives))
                self.parse_group_start()
                alternatives = [[]]
            elif char == "" or (
                char == "$" and self.pos == len(self.pattern) - 1 and not open_groups
            ):
                if open_groups:
                    raise self.error("unbalanced parenthesis", open_groups[-1][0])
                return _choice(alternatives)
            else:
                alternatives[-1].append(self.parse_quantifier(self.parse_atom()))

    def parse_quantifier(self, atom):
        bounds = self.read_repeat_bounds()
        if bounds is None:
            return atom
        # A lazy quantifier matches the same set of strings under fullmatch.
        if self.peek() == "?":
            self.pos += 1
        elif self.peek() == "+":
            raise self.error("possessive quantifiers are not supported", self.pos)
        if self.read_repeat_bounds(advance=False) is not None:
            raise self.error("multiple repeat", self.pos)
        return Repeat(atom, *bounds)

    def read_repeat_bounds(self, advance=True):
        """(min, max) of a quantifier at `pos`, or None; `{` that is no quantifier is a literal, as
        in `re`."""
        start = self.pos
        char = self.peek()
        if char and char in "*+?":
            bounds, end = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char], start + 1
        elif char == "{":
            close = self.pattern.find("}", start)
            low, comma, high = self.pattern[start + 1 : close].partition(",")
            if close < 0 or close == start + 1 or not set(low + high) <= set("0123456789"):
                return None
            min_count = int(low) if low else 0
            max_count = int(high) if high else (None if comma else min_count)
            if max_count is not None and min_count > max_count:
                raise self.error("min repeat greater than max repeat", start + 1)
            bounds, end = (min_count, max_count), close + 1
        else:
            return None
        if advance:
            self.pos = end
        return bounds

    def parse_atom(self):
        start = self.pos
        if self.read_repeat_bounds(advance=False) is not None:
            raise self.error("nothing to repeat", start)
        char = self.pattern[start]
        self.pos += 1
        if char == "[":
            return Chars(self.parse_class(start))
        if char == ".":
            return Chars(ANY_BUT_NEWLINE)
        if char == "\\":
            return Chars(self.parse_escape(start, in_class=False))
        if char in "^$":
            raise self.error(
                f"anchor {char} is only supported at the start (^) or end ($) of the pattern", start
            )
        return Chars(((ord(char), ord(char)),))

    def parse_group_start(self):
        """Step over "(" and a "?:" or "?P<name>" prefix; RegexError for group kinds we do not
        support."""
        start = self.pos
        self.pos += 1
        if self.pattern.startswith("?:", self.pos):
            self.pos += 2
        elif self.pattern.startswith("?P<", self.pos):
            close = self.pattern.find(">", self.pos)
            if close < 0 or not self.pattern[self.pos + 3 : close].isidentifier():
                raise self.error("bad group name", self.pos + 3)
            self.pos = close + 1
        elif self.peek() == "?":
            feature = next(
                (
                    name
                    for prefix, name in UNSUPPORTED_GROUPS.items()
                    if self.pattern.startswith(prefix, self.pos)
                ),
                None,
            )
            if feature is None:
                raise self.error(
                    f"unsupported group syntax {self.pattern[start : start + 3]}", start
                )
            raise self.error(f"{feature} not supported", start)

    def parse_class(self, start):
        negate = self.peek() == "^"
        if negate:
            self.pos += 1
        ranges, first_item = [], self.pos
        while True:
            if self.pos >= len(self.pattern):
                raise self.error("unterminated character set", start)
            # a "]" right after "[" or "[^" is a literal
            if self.peek() == "]" and self.pos != first_item:
                self.pos += 1
                break
            item_start = self.pos
            item = self.parse_class_item()
            # not a range
            if self.peek() != "-" or self.pattern[self.pos + 1 : self.pos + 2] in ("", "]"):
                ranges.extend(item)
                continue
            self.pos += 1
            lo, hi = _single_code(item), _single_code(self.parse_class_item())
            if lo is None or hi is None or lo > hi:
                raise self.error(
                    f"bad character range {self.pattern[item_start : self.pos]}", item_start
                )
            ranges.append((lo, hi))
        return complement_ranges(normalize_ranges(ranges)) if negate else normalize_ranges(ranges)

    def parse_class_item(self):
        start = self.pos
        if self.peek() == "\\":
            return self.parse_escape(start, in_class=True)
        self.pos += 1
        return ((ord(self.pattern[start]),) * 2,)

    def parse_escape(self, start, in_class):
        """The character set of the escape at `start`; `pos` ends up after it."""
        self.pos = start + 1
        char = self.peek()
        if not char:
            raise self.error("bad escape (end of pattern)", start)
        self.pos += 1
        if char in CLASS_ESCAPES:
            return CLASS_ESCAPES[char]
        if char in CHAR_ESCAPES or (char == "b" and in_class):
            code = ord(CHAR_ESCAPES.get(char, "\b"))
        elif char in HEX_ESCAPE_DIGITS:
            digits = self.pattern[self.pos : self.pos + HEX_ESCAPE_DIGITS[char]]
            if len(digits) < HEX_ESCAPE_DIGITS[char] or any(
                c not in "0123456789abcdefABCDEF" for c in digits
            ):
                raise self.error(f"incomplete escape \\{char}{digits}", start)
            self.pos += len(digits)
            code = int(digits, 16)
            if code > MAX_CODEPOINT:
                raise self.error(f"bad escape \\{char}{digits}", start)
        elif char in "0123456789":
            raise self.error("backreferences and octal escapes are not supported", start)
        elif char in "bBAZ":
            raise self.error(f"anchor \\{char} is not supported", start)
        elif char.isascii() and char.isalpha():
            raise self.error(f"bad escape \\{char}", start)
        else:
            code = ord(char)
        return ((code, code),)


def _choice(alternatives):
    """The node for alternatives given as lists of items; a lone item or option stands as it is."""
    options = [items[0] if len(items) == 1 else Concat(tuple(items)) for items in alternatives]
    return options[0] if len(options) == 1 else Alt(tuple(options))


def parse_regex(pattern: str, max_depth=None):
    """Parse `pattern` into a tree of `Chars`, `Concat`, `Alt` and `Repeat` nodes.

    Args:
        max_depth: Most groups open at once (None: no limit; the parser keeps its own stack);
            deeper nesting is a RegexError, for callers that walk the tree recursively.
    """
    return _Parser(pattern, max_depth).parse()
