"""Reasoning in every API: what a request asks of the think block, and the answer's text split from it.

Each API says it its own way (chat: ``reasoning_effort``, ``thinking_token_budget``,
``chat_template_kwargs``; Responses: ``reasoning.effort``; Messages: ``thinking`` and
``output_config.effort``); each becomes a ``ThinkingRequest``, and ``Thinking`` is what the engine
and the formats need once the prompt is rendered. Effort levels map to budgets through
``EFFORT_BUDGETS`` (``python -m server --effort-budgets`` changes it). A budget bounds the tokens
inside the block; the block's closing text is then forced (constrained/thinking.py). Reasoning counts
against max_tokens, as in Anthropic's API.
"""

from dataclasses import dataclass, field
from typing import Optional

from constrained.thinking import (ANSWER, START, THINKING, ThinkingConstraint, ThinkingForcedSource, ThinkMarkers,
                                  reasoning_token_count, think_markers)

# Effort -> the most tokens inside the think block (None: unbounded). "none" turns thinking off.
EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768, "max": None}


def parse_effort_budgets(text: str, table: Optional[dict] = None) -> dict:
    """``"low=512,high=8192"`` over ``table`` (default EFFORT_BUDGETS); ``none`` as a value: unbounded.
    ValueError names a bad entry."""
    budgets = dict(EFFORT_BUDGETS if table is None else table)
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = entry.partition("=")
        name, value = name.strip(), value.strip()
        if not name or name == "none" or not value:
            raise ValueError(f"'{entry}': give effort=tokens, e.g. low=512 (the effort 'none' turns thinking off)")
        if value.lower() == "none":
            budgets[name] = None
        elif value.isdigit() and int(value) > 0:
            budgets[name] = int(value)
        else:
            raise ValueError(f"'{entry}': the budget must be a positive number of tokens or 'none'")
    return budgets


@dataclass
class ThinkingRequest:
    """What a request asks: thinking on (True), off (False) or as the template has it (None), a budget
    (None: none), and options for the chat template (``chat_template_kwargs``)."""

    enabled: Optional[bool] = None
    budget: Optional[int] = None
    template_options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Thinking:
    """A request on a thinking model, once its prompt is rendered: the markers, where the prompt leaves the
    model (START, THINKING or ANSWER) and the budget (None: none; 0: the block never opens or closes at once)."""

    markers: ThinkMarkers
    phase: str
    budget: Optional[int] = None

    def reasoning_tokens(self, tokens: list) -> int:
        return reasoning_token_count(tokens, self.markers, self.phase)


def around_thinking(thinking: Optional[Thinking], constraint, forced, vocab_size: int) -> tuple:
    """``(constraint, forced)`` for the answer, put after the think block (with its budget) on a thinking
    model; as they are where nothing bounds the block or follows it (no cost for such a request)."""
    if thinking is None or thinking.phase == ANSWER or (constraint is None and thinking.budget is None):
        return constraint, forced
    wrapped = ThinkingConstraint(thinking.markers, vocab_size, constraint, thinking.budget, thinking.phase)
    return wrapped, ThinkingForcedSource(wrapped, forced)


def template_options(asked: ThinkingRequest, tokenizer) -> dict:
    """Options for the chat template: the request's own, and ``enable_thinking`` when it says on or off
    (mlx-lm's wrapper passes it under the name the template reads)."""
    options = dict(asked.template_options)
    if asked.enabled is not None and think_markers(tokenizer) is not None:
        options.setdefault("enable_thinking", asked.enabled)
    return options


def thinking_of(asked: ThinkingRequest, tokenizer, prompt: list) -> Optional[Thinking]:
    """The request's ``Thinking`` (None for a model without think markers: it answers as it is, which
    docs/server.md says). Thinking off where the template still opened the block (or may let the model
    open it): a budget of 0, so the block closes at once or never opens."""
    markers = think_markers(tokenizer)
    if markers is None:
        return None
    phase = markers.phase(prompt, tokenizer.decode)
    budget = 0 if asked.enabled is False else asked.budget
    return Thinking(markers, phase, budget)


class ReasoningSplitter:
    """Streamed text -> ``("reasoning", text)`` and ``("text", text)`` pieces, split at the think
    markers. Whitespace around the reasoning and before the answer is dropped; text that may be the
    start of a marker is held back until it cannot be."""

    def __init__(self, thinking: Optional[Thinking]):
        self.markers = thinking.markers if thinking is not None else None
        self.phase = ANSWER if thinking is None else thinking.phase
        self.held = ""
        self.started = False  # reasoning shown yet
        self.after_block = False  # the answer follows a block: its leading whitespace is dropped

    def add(self, piece: str) -> list:
        self.held += piece
        out = []
        if self.phase == START:
            text = self.held.lstrip()
            if text.startswith(self.markers.start):
                self.phase, self.held = THINKING, text[len(self.markers.start):]
            elif self.markers.start.startswith(text):
                return out  # still may open the block
            else:
                self.phase = ANSWER
        if self.phase == THINKING:
            index = self.held.find(self.markers.end)
            if index < 0:
                end = self.markers.end
                keep = max((k for k in range(1, len(end)) if self.held.endswith(end[:k])), default=0)
                return self._reasoning(len(self.held) - keep)
            text, rest = self.held[:index], self.held[index + len(self.markers.end):]
            self.held = text
            out += self._reasoning(len(text), closing=True)
            self.phase, self.held, self.after_block = ANSWER, rest, True
        if self.after_block:
            self.held = self.held.lstrip()
            self.after_block = not self.held
        if self.held:
            out.append(("text", self.held))
            self.held = ""
        return out

    def _reasoning(self, cut: int, closing: bool = False) -> list:
        """Show ``held[:cut]`` as reasoning, less the whitespace at its start and (held back) at its end."""
        body = self.held[:cut]
        if not self.started:
            body = body.lstrip()
            self.held = self.held[cut - len(body):]
            cut = len(body)
        shown = body.rstrip()
        self.held = "" if closing else self.held[len(shown):]
        self.started = self.started or bool(shown)
        return [("reasoning", shown)] if shown else []

    def finish(self) -> list:
        """What is held at the end: unfinished reasoning (cut by max_tokens), or answer text."""
        if self.phase == THINKING:
            return self._reasoning(len(self.held), closing=True)
        text, self.held = (self.held.lstrip() if self.after_block else self.held), ""
        return [("text", text)] if text else []


def split_reasoning(thinking: Optional[Thinking], text: str) -> tuple:
    """``(reasoning, answer)`` of a whole output."""
    splitter = ReasoningSplitter(thinking)
    pieces = splitter.add(text) + splitter.finish()
    return ("".join(t for kind, t in pieces if kind == "reasoning"),
            "".join(t for kind, t in pieces if kind == "text"))
