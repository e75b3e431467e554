"""An independent parser for grammar-constrained outputs: the `lark` package on the same grammar.

llguidance's Lark dialect is close to the `lark` package's; three differences are bridged here.
Uppercase rules (llguidance lexemes) become ordinary lowercase rules, so lark's Earley parser reads
them character by character with no lexer of its own; `x{m,n}` becomes `x ~ m..n`; an empty
string `""` becomes an empty alternative. Everything else (strings, /regexes/, `|`, `?`, `*`,
`+`, groups) is shared syntax.
"""

import re

import lark

TOKEN = re.compile(
    r'(?P<comment>//[^\n]*)|(?P<string>"(?:[^"\\]|\\.)*"i?)|(?P<regex>/(?:[^/\\\n]|\\.)+/[imsx]*)'
    r"|(?P<repeat>\{\s*(\d+)\s*(?:,\s*(\d+)\s*)?\})|(?P<name>[A-Za-z_]\w*)|(?P<other>[\s\S])"
)


def lark_parser(lark_text: str) -> lark.Lark:
    """A `lark.Lark` Earley parser (start rule `start`) for a grammar in llguidance's Lark
    dialect."""
    out = []
    for match in TOKEN.finditer(lark_text):
        kind, value = match.lastgroup, match.group()
        if kind == "comment" or (kind == "string" and value == '""'):
            value = ""
        elif kind == "name" and re.fullmatch(r"[A-Z][A-Z_0-9]*", value):
            value = "t_" + value.lower()
        elif kind == "repeat":
            low, high = match.group(5), match.group(6)
            value = f" ~ {low}" if high is None else f" ~ {low}..{high}"
        out.append(value)
    text = "\n".join(
        line for line in "".join(out).splitlines() if not line.startswith("%llguidance")
    )
    return lark.Lark(text, start="start", parser="earley", lexer="dynamic")


def parses(parser: lark.Lark, text: str) -> bool:
    try:
        parser.parse(text)
        return True
    except lark.exceptions.LarkError:
        return False
