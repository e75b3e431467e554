"""GPT-OSS's harmony format: the answer's messages read as text and tool calls.

A harmony model writes messages, each a header and a body: ``<|channel|>final<|message|>Hi<|end|>``.
The ``analysis`` channel is the reasoning (split off first, as a think block:
constrained/thinking.py); ``final`` is the answer; a message to ``functions.NAME`` is a call of that
tool, its body the arguments' JSON, ended by ``<|call|>`` (an EOS token, so usually the output's
end). The recipient may stand before the channel or after it:

    <|start|>assistant<|channel|>commentary to=functions.get_weather
    <|constrain|>json<|message|>{"city": "Paris"}<|call|> <|start|>assistant
    to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>

``HarmonyReader`` reads the text after the reasoning: a final or commentary message without a
recipient (a preamble) is text, a message to a function is a ``Call``, an analysis message past the
first is dropped. Text with no header (the think block's closing text already opened the final
channel) is text. Calls are parsed, not held to their schemas: a grammar after the reasoning would
have to choose between the final channel and a call, where the think block's closing forces the
final channel.
"""

import json
import re
from typing import Optional

from server.tools import TextReader, ToolSyntax, calls_of, tool_syntax

# how a header can begin
HEADERS = ("<|start|>", "<|channel|>", "to=", "<|constrain|>", "<|message|>")
ENDS = ("<|end|>", "<|call|>", "<|return|>")  # what ends a message's body
NEXT = ("<|start|>", "<|channel|>")  # a new header, which also ends the body before it
RECIPIENT = re.compile(r"to=([^\s<]+)")
CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


def chat_tool_syntax(tokenizer) -> Optional[ToolSyntax]:
    """The syntax the tokenizer's chat template writes calls in: harmony's where the template is
    GPT-OSS's (its calls end with ``<|call|>``), else the one ``tools.tool_syntax`` knows, or
    None."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "<|channel|>" in template and "<|call|>" in template:
        return ToolSyntax(
            "harmony", "<|start|>", "<|call|>", parse_harmony_call, reader=HarmonyReader
        )
    return tool_syntax(tokenizer)


def parse_harmony_call(message: str, tools=None) -> dict:
    """``{"name", "arguments"}`` of one message to a function: its header, ``<|message|>``, its
    JSON."""
    header, _, body = message.partition("<|message|>")
    recipient = RECIPIENT.search(header)
    if recipient is None or not recipient.group(1).startswith("functions."):
        raise ValueError("not a call: the message has no function as its recipient")
    return {"name": recipient.group(1)[len("functions.") :], "arguments": json.loads(body)}


class HarmonyReader(TextReader):
    """Text and calls out of harmony messages (see the module docstring). Text that may begin a
    header or end a body is held back until it cannot; a call cut short (max_tokens) is dropped."""

    def __init__(self, syntax: ToolSyntax = None, tools: list = ()):
        self.tools = list(tools)
        self.pending = ""  # text not read yet
        # "between" messages, in a "header" (up to <|message|>), or in a "body"
        self.state = "between"
        self.header = self.body = ""  # the open message's header, and its body not yet shown

    def add(self, piece: str) -> list:
        self.pending += piece
        out = []
        while self.pending:
            if self.state == "between":
                self.pending = self.pending.lstrip()
                opens = any(self.pending.startswith(h) for h in HEADERS)
                if not opens and any(h.startswith(self.pending) for h in HEADERS):
                    return out  # may still open a header
                # else a bare body: text
                self.state, self.header = ("header", "") if opens else ("body", "")
            elif self.state == "header":
                index = self.pending.find("<|message|>")
                if index < 0:
                    return out
                self.header, self.pending = (
                    self.pending[:index],
                    self.pending[index + len("<|message|>") :],
                )
                self.state = "body"
            elif not self._body(out):
                return out
        return out

    def _body(self, out: list) -> bool:
        """Read the open body from ``pending``; True when it ended (and the reader moved past
        it)."""
        found = [(i, end) for end in ENDS + NEXT if (i := self.pending.find(end)) >= 0]
        if not found:
            keep = max(
                (
                    k
                    for end in ENDS + NEXT
                    for k in range(1, len(end))
                    if self.pending.endswith(end[:k])
                ),
                default=0,
            )
            self._grow(self.pending[: len(self.pending) - keep], out)
            self.pending = self.pending[len(self.pending) - keep :]
            return False
        index, end = min(found)
        self._grow(self.pending[:index], out)
        out += self._ended()
        self.pending = self.pending[index + (0 if end in NEXT else len(end)) :]
        return True

    def _kind(self) -> str:
        """ "call", "text" or "drop" (reasoning) for the open message, from its header."""
        recipient = RECIPIENT.search(self.header)
        if recipient is not None and recipient.group(1).startswith("functions."):
            return "call"
        channel = CHANNEL.search(self.header)
        return "drop" if channel is not None and channel.group(1) == "analysis" else "text"

    def _grow(self, text: str, out: list):
        """More of the body: a text message shows it, its trailing whitespace held in case the body
        ends."""
        self.body += text
        if self._kind() == "text" and (shown := self.body.rstrip()):
            out.append(shown)
            self.body = self.body[len(shown) :]

    def _ended(self) -> list:
        """The items of the message that just ended: its call, if it is one that parses."""
        kind, header, body = self._kind(), self.header, self.body
        self.state, self.header, self.body = "between", "", ""
        if kind != "call":
            return []
        try:
            return calls_of(parse_harmony_call(header + "<|message|>" + body, self.tools))
        except (ValueError, KeyError, TypeError):  # not JSON (cut short): no call
            return []

    def finish(self) -> list:
        text, self.pending = self.pending, ""
        if self.state == "header" or (self.state == "between" and text.startswith("<|")):
            return []  # a header cut short is markup, not text
        if self.state == "between":
            return [text] if text else []
        out = []
        self._grow(text, out)
        return out + self._ended()
