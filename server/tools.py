"""Tool calls in the model's own syntax: read out of its text, their arguments held to their
schemas.

A chat template that knows tools writes a call its own way: Hermes and Qwen
``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``, Mistral ``[TOOL_CALLS] [{...}]``,
Llama 3 a bare ``{"name": ..., "parameters": ...}``. mlx-lm recognises the template when it loads
the tokenizer and gives the markers and a parser (``tokenizer.tool_call_start``, ``tool_call_end``,
``tool_parser``); Llama 3's bare JSON it does not, so that one is recognised here.

- ``ToolSyntax``: the markers, the parser and, for the JSON syntaxes, an llguidance grammar in
  which the model writes free text until it opens a call, after which the call follows its
  tool's schema (a lazy trigger: llguidance's docs/syntax.md, "Tool calling"). Every call then
  parses, and the forced-text source drafts what the schema forces (``{"name": "``) for free.
- ``CallReader``: splits the streamed text into text and calls, holding back what may be the start
  of a marker, so that a stream never shows the markup.
- ``JsonCallReader``: a forced call where the template has no syntax: the whole output is the
  call's JSON, constrained by its schema (the server's first tool calls, kept as they were).
"""

import functools
import json
from dataclasses import dataclass
from typing import Callable, Optional

# json.dumps' separators, as templates write a call (``tojson``). Lenient: a keyword llguidance does
# not implement is left unchecked rather than refusing the request (an agent sends dozens of tools).
CALL_JSON = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": True,
}
TEXT = r"/(.|\n)*/"


@dataclass(frozen=True)
class Function:
    """A tool the model may call, whichever API described it."""

    name: str
    parameters: dict  # JSON Schema of the arguments
    description: str = ""

    def for_template(self) -> dict:
        """The tool as chat templates and mlx-lm's parsers read it (OpenAI's chat form)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


@dataclass(frozen=True)
class Call:
    """A parsed call: ``arguments`` is JSON text; ``id`` the model's own, if it wrote one."""

    name: str
    arguments: str
    id: Optional[str] = None


@dataclass(frozen=True)
class ToolSyntax:
    """How a template writes a call: ``start`` BODY ``end`` (an empty ``end``: the call runs to the
    end of the output; ``at_start``: a call can only open the output, its marker part of its
    body)."""

    name: str
    start: str
    end: str
    # mlx-lm's parse_tool_call(body, tools) -> {"name", "arguments"} or a list of them
    parse: Callable
    # (functions, parallel, literal) -> Lark for BODY; None: unconstrained
    body: Optional[Callable] = None
    at_start: bool = False
    special: tuple = ()  # (marker, token id) for markers that are special tokens
    # its own reader class, (syntax, tools) -> TextReader; None: CallReader
    reader: Optional[Callable] = None

    def literal(self, marker: str) -> str:
        """``marker`` in Lark: a special token by id (text cannot spell one), else a string."""
        token = dict(self.special).get(marker)
        return f"<[{token}]>" if token is not None else json.dumps(marker)

    def grammar(self, functions: list, forced: bool, parallel: bool) -> Optional[str]:
        """llguidance Lark for an output of free text and calls (``forced``: calls only, at least
        one), or None when the body is not constrained."""
        if self.body is None:
            return None
        body = self.body(functions, parallel, self.literal)
        end = self.literal(self.end) if self.end else ""
        opening = "" if self.at_start else self.literal(self.start)
        lines = ["%llguidance {}"]
        if forced:
            repeat = parallel and self.end  # without an end marker, one body holds every call
            lines += [
                'start: call ("\\n" call)*' if repeat else "start: call",
                f"call: {opening} {body} {end}",
            ]
        elif self.at_start:  # text that does not open like a call, or a call
            lines += ["start: FREE | call", f"FREE: /([^{self.start}](.|\\n)*)?/", f"call: {body}"]
        else:
            # a special token: the text cannot spell it, so no trigger is needed
            if opening.startswith("<["):
                lines.append(f"call: TEXT {opening} {body} {end}")
            else:  # the text ends at the first marker (lazy), then the body starts
                lines += [f"opening[lazy]: TEXT {opening}", f"call: opening {body} {end}"]
            calls = ("call*" if parallel else "call?") + " TEXT" if self.end else "TEXT | call"
            lines += [f"start: {calls}", f"TEXT: {TEXT}"]
        return "\n".join(lines) + "\n"


def _json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": CALL_JSON})


def _call_schema(
    functions: list, arguments: str = "arguments", extra: Optional[dict] = None
) -> dict:
    """One call object: ``{"name": <a tool>, <arguments>: <its schema>}``."""
    return {
        "anyOf": [
            {
                "type": "object",
                "required": ["name", arguments],
                "additionalProperties": False,
                "properties": {
                    "name": {"const": f.name},
                    arguments: f.parameters or {"type": "object"},
                    **(extra or {}),
                },
            }
            for f in functions
        ]
    }


def _hermes_body(functions, parallel, literal) -> str:
    # Qwen 2.5/3 and Hermes: '<tool_call>\n{"name": "' + name + '", "arguments": ' + tojson +
    # '}\n</tool_call>'
    return f'"\\n" {_json(_call_schema(functions))} "\\n"'


def _mistral_body(functions, parallel, literal) -> str:
    # v0.3 templates: '[TOOL_CALLS] [' + calls + ']', each with a 9-character id the model may write
    # too.
    calls = _call_schema(functions, extra={"id": {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}})
    array = {"type": "array", "items": calls, "minItems": 1, "maxItems": 64 if parallel else 1}
    return f'" "? {_json(array)}'


def _mistral_args_body(functions, parallel, literal) -> str:
    # Newer templates: '[TOOL_CALLS]' + name + '[ARGS]' + tojson, once per call.
    one = " | ".join(
        f"{json.dumps(f.name)} {literal('[ARGS]')} {_json(f.parameters or {'type': 'object'})}"
        for f in functions
    )
    return f"({one})" + (f" ({literal('[TOOL_CALLS]')} ({one}))*" if parallel else "")


def _llama3_body(functions, parallel, literal) -> str:
    # Llama 3.1/3.2: '{"name": "' + name + '", "parameters": ' + tojson + '}' as the whole message.
    return _json(_call_schema(functions, "parameters"))


def _parse_llama3(body: str, tools=None) -> dict:
    call = json.loads("{" + body)  # the marker, "{", opens the JSON
    return {"name": call["name"], "arguments": call["parameters"]}


BODIES = {"json_tools": _hermes_body, "mistral": _mistral_body}


@functools.lru_cache(maxsize=8)
def tool_syntax(tokenizer) -> Optional[ToolSyntax]:
    """The syntax the tokenizer's chat template writes calls in, or None when it has none we
    know."""
    # mlx-lm's TokenizerWrapper has a parser once it has recognised the template; others have none.
    parser = getattr(tokenizer, "tool_parser", None)
    # as text.encode: not every tokenizer has one
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    if parser is not None:
        name = parser.__module__.rsplit(".", 1)[-1]  # mlx_lm.tool_parsers.<name>
        body = (
            _mistral_args_body if name == "mistral" and "[ARGS]" in template else BODIES.get(name)
        )
        start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
        markers = [start, end] + (["[ARGS]"] if body is _mistral_args_body else [])
        return ToolSyntax(
            name, start, end, parser, body, special=_special_tokens(tokenizer, markers)
        )
    if '"parameters": ' in template and "tool_call" in template:
        return ToolSyntax("llama3_json", "{", "", _parse_llama3, _llama3_body, at_start=True)
    return None


def _special_tokens(tokenizer, markers: list) -> tuple:
    """(marker, id) for each marker that is one special token (llguidance's view of the
    vocabulary)."""
    from constrained.grammar import GrammarError, ll_tokenizer_of

    try:
        ll_tokenizer = ll_tokenizer_of(tokenizer)
    except GrammarError:  # no llguidance: calls are parsed, not constrained
        return ()
    found = []
    for marker in filter(None, markers):
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and ll_tokenizer.is_special_token(ids[0]):
            found.append((marker, ids[0]))
    return tuple(found)


def calls_of(parsed) -> list:
    """mlx-lm parsers give a dict or a list of dicts with the arguments as a dict (or JSON text)."""
    result = []
    for call in parsed if isinstance(parsed, list) else [parsed]:
        arguments = call.get("arguments", {})
        arguments = (
            arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        )
        result.append(Call(call["name"], arguments, call.get("id")))
    return result


class TextReader:
    """No tools: every piece of text is text. ``add(piece)`` and ``finish()`` return a list of
    str (text to show) and ``Call`` (a complete call), as the readers below do."""

    def add(self, piece: str) -> list:
        return [piece] if piece else []

    def finish(self) -> list:
        return []


class CallReader(TextReader):
    """Text and calls out of text written in ``syntax``. Text that may begin the start marker is
    held back until it cannot; whitespace between text and a call is dropped; a call whose end
    marker never comes (cut by max_tokens) is dropped, as is one the parser refuses."""

    def __init__(self, syntax: ToolSyntax, tools: list):
        self.syntax, self.tools = syntax, tools
        self.pending = ""  # text not shown yet: maybe a marker's start, or whitespace before a call
        self.body = None  # the open call's text after its start marker; None outside a call
        self.after_call = False  # whitespace right after a call is dropped
        self.opened = False  # any text seen yet (a call ``at_start`` must open the output)

    def add(self, piece: str) -> list:
        out = []
        if self.body is not None:
            self.body += piece
        else:
            self.pending += piece
        while True:
            if self.body is not None:
                if not self.syntax.end or (index := self.body.find(self.syntax.end)) < 0:
                    return out
                out += self._parsed(self.body[:index])
                self.pending, self.body, self.after_call = (
                    self.body[index + len(self.syntax.end) :],
                    None,
                    True,
                )
            if self.after_call:
                self.pending = self.pending.lstrip()
            if not self.pending:
                return out
            start = self.syntax.start
            index = self.pending.find(start)
            if self.syntax.at_start and (self.opened or index > 0):
                index = -1  # text came first: no call in this output
            if index < 0:
                if self.syntax.at_start and not self.opened and start.startswith(self.pending):
                    return out  # still may open as a call
                keep = (
                    0
                    if self.syntax.at_start
                    else max(
                        (k for k in range(1, len(start)) if self.pending.endswith(start[:k])),
                        default=0,
                    )
                )
                shown = self.pending[: len(self.pending) - keep].rstrip()
                if shown:
                    out.append(shown)
                    self.opened, self.after_call = True, False
                self.pending = self.pending[len(shown) :]
                return out
            if text := self.pending[:index].rstrip():
                out.append(text)
            self.body, self.pending, self.opened = self.pending[index + len(start) :], "", True

    def finish(self) -> list:
        if self.body is not None:
            return [] if self.syntax.end else self._parsed(self.body)
        # held whitespace or a marker's start that never finished
        text, self.pending = self.pending, ""
        return [text] if text else []

    def _parsed(self, body: str) -> list:
        try:
            return calls_of(self.syntax.parse(body, self.tools))
        # mlx-lm's parsers raise these on bad text
        except (ValueError, KeyError, TypeError, AttributeError):
            return []


class JsonCallReader(TextReader):
    """A forced call without a template syntax: the output is ``{"name": ..., "arguments": ...}``
    (``name`` None, "required") or the named tool's arguments. Shown as text if it does not parse
    (a stop string or max_tokens cut it)."""

    def __init__(self, name: Optional[str]):
        self.name, self.text = name, ""

    def add(self, piece: str) -> list:
        self.text += piece
        return []

    def finish(self) -> list:
        try:
            call = json.loads(self.text)
            if self.name is not None:
                return [Call(self.name, self.text)]
            return [Call(call["name"], json.dumps(call["arguments"]))]
        except (json.JSONDecodeError, KeyError, TypeError):
            return [self.text] if self.text else []


@dataclass
class ToolUse:
    """A request's tools, how its output is constrained and how calls are read out of it.

    ``choice``: "auto", "required" or a tool's name. With a syntax the model writes calls its own
    way, forced or not; without one, a forced call is bare JSON and ``auto`` gives text only.
    """

    functions: list
    choice: str
    parallel: bool = True
    syntax: Optional[ToolSyntax] = None

    def __post_init__(self):
        forced = self.choice != "auto"
        if forced and (self.syntax is None or self.syntax.body is None):
            self.syntax = None  # bare JSON: no grammar for this syntax's body
        if self.choice not in ("auto", "required"):
            self.functions = [f for f in self.functions if f.name == self.choice]

    def grammar(self) -> Optional[str]:
        """Lark for the output, or None (no syntax, or one whose body is not constrained)."""
        return (
            None
            if self.syntax is None
            else self.syntax.grammar(self.functions, self.choice != "auto", self.parallel)
        )

    def json_schema(self) -> Optional[dict]:
        """The bare-JSON forced call's schema (no syntax), or None."""
        if self.syntax is not None or self.choice == "auto":
            return None
        if self.choice == "required":  # one object naming the function and holding its arguments
            return _call_schema(self.functions)
        return self.functions[0].parameters or {"type": "object"}

    def reader(self) -> TextReader:
        if self.syntax is not None:
            return (self.syntax.reader or CallReader)(
                self.syntax, [f.for_template() for f in self.functions]
            )
        if self.choice == "auto":
            return TextReader()
        return JsonCallReader(None if self.choice == "required" else self.choice)


def reader_for(tools: Optional[ToolUse]) -> TextReader:
    return TextReader() if tools is None else tools.reader()


def split(reader: TextReader, text: str) -> tuple:
    """``(text, calls)`` of a whole output."""
    items = reader.add(text) + reader.finish()
    return "".join(i for i in items if isinstance(i, str)), [
        i for i in items if isinstance(i, Call)
    ]
