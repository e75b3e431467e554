"""Thinking models: the think block found per tokenizer, bounded by a budget, and constraints that
start after it.

A thinking model writes ``<think> reasoning </think>`` before its answer (Qwen3, DeepSeek R1, GLM,
Kimi, ...), or its template opens the block in the prompt (Qwen3.5, Qwen3-Thinking-2507).
``ThinkMarkers`` (think_markers.py) reads the markers from mlx-lm's ``TokenizerWrapper``
(``has_thinking``, ``think_start``, ``think_end``) and the separator its template writes after the
block.
``ThinkingConstraint`` wraps an answer's constraint (a regex, grammar, schema or tool grammar; or
none) so that the loop needs to know nothing of thinking:

    START     the model may open the block, or answer at once (the inner constraint's first mask,
              plus the opening)
    OPENING   the rest of a multi-token opening marker, forced
    THINKING  free text; once ``budget`` tokens are spent the closing text is forced
    CLOSING   the end marker and the template's separator, forced (drafted for free:
              ``ThinkingForcedSource``)
    ANSWER    the inner constraint, from its start state

    thinking = thinking_of(tokenizer, prompt, budget=256)   # None: the model does not think
    constraint, forced = thinking.around(inner, inner_forced, vocab_size)
"""

from dataclasses import dataclass
from typing import NamedTuple, Optional

import mlx.core as mx
import numpy as np

from constrained.think_markers import (
    ANSWER,
    CLOSING,
    OPENING,
    START,
    THINKING,
    ThinkMarkers,
    think_markers,
)
from decoder.draft import Constraint, Draft, DraftSource
from decoder.sampling import Sampling


class ThinkState(NamedTuple):
    """Where a row is: its phase, tokens spent thinking, the marker tokens matched so far (of the
    opening or closing text), and in ANSWER (or START) the inner constraint's state."""

    phase: str
    spent: int = 0
    matched: int = 0
    inner: object = None


class ThinkingConstraint(Constraint):
    """A think block of free text (at most ``budget`` tokens, then its closing text forced),
    followed by ``inner`` (None: free text). ``budget`` 0 with the block not yet open: it never
    opens; None: no bound.

    Args:
        markers: ``think_markers(tokenizer)``.
        vocab_size: the logits' width.
        phase: where the prompt leaves the model (``markers.phase``): START, THINKING or ANSWER.
    """

    def __init__(
        self,
        markers: ThinkMarkers,
        vocab_size: int,
        inner: Optional[Constraint] = None,
        budget: Optional[int] = None,
        phase: str = START,
    ):
        self.markers, self.vocab_size, self.inner, self.budget = markers, vocab_size, inner, budget
        self.first_phase = phase
        self.reset()

    def reset(self):
        if self.inner is not None:
            self.inner.reset()
        self.state = self._entering(ThinkState(self.first_phase))

    def _entering(self, state: ThinkState) -> ThinkState:
        """``state``, or where it leads at once: a spent budget closes the block, a finished marker
        ends its phase."""
        if state.phase == THINKING and self.budget is not None and state.spent >= self.budget:
            return ThinkState(CLOSING, state.spent, state.matched)
        if state.phase == OPENING and state.matched == len(self.markers.start_tokens):
            return self._entering(ThinkState(THINKING))
        if state.phase == CLOSING and state.matched == len(self.markers.close_tokens):
            return ThinkState(ANSWER, state.spent)
        return state

    def _opens(self, token: int) -> bool:
        """Whether ``token`` opens the block. With a budget of 0 a one-token marker never opens it;
        a longer one (harmony's) opens and closes at once, since its first token also starts other
        text."""
        return token == self.markers.start_tokens[0] and (
            self.budget != 0 or len(self.markers.start_tokens) > 1
        )

    def _step(self, state: ThinkState, token: int) -> Optional[ThinkState]:
        """The state after ``token`` in an own phase (not ANSWER); None where it is forbidden."""
        end = self.markers.end_tokens
        if state.phase == START:  # only an opening marker reaches here (see walk)
            return self._entering(ThinkState(OPENING, matched=1))
        if state.phase in (OPENING, CLOSING):
            forced = (
                self.markers.start_tokens if state.phase == OPENING else self.markers.close_tokens
            )
            return (
                self._entering(state._replace(matched=state.matched + 1))
                if token == forced[state.matched]
                else None
            )
        matched = state.matched + 1 if token == end[state.matched] else int(token == end[0])
        if matched == len(end):  # the model closed the block itself
            # a constrained answer gets the separator too
            after = ANSWER if self.inner is None else CLOSING
            return self._entering(ThinkState(after, state.spent + 1, matched))
        return self._entering(ThinkState(THINKING, state.spent + 1, matched))

    def walk(self, draft: list) -> list:
        states, state = [], self.state
        for i, token in enumerate(draft):
            if state.phase == ANSWER or (state.phase == START and not self._opens(token)):
                return states + self._inner_walk(state, draft[i:])
            following = self._step(state, token)
            if following is None:
                return states + [state]
            states += self._inner_walk(state, []) if state.phase == START else [state]
            state = following
        return states + (self._inner_walk(state, []) if state.phase in (START, ANSWER) else [state])

    def _inner_walk(self, state: ThinkState, rest: list) -> list:
        """The inner constraint's states along ``rest`` (from its committed state, which is its
        start until the answer begins), as ANSWER states; the first keeps a START phase."""
        inner = self.inner.walk(rest) if self.inner is not None else [None] * (len(rest) + 1)
        return [
            ThinkState(state.phase if i == 0 else ANSWER, state.spent, 0, s)
            for i, s in enumerate(inner)
        ]

    def masks(self, states: list) -> mx.array:
        """Own phases' rows (all tokens while thinking, the forced token in a marker); the inner
        constraint's for a run of START/ANSWER states, one call per run as its ``walk`` gave
        them."""
        rows, run = [], []
        for state in states + [None]:
            if state is not None and state.phase in (START, ANSWER):
                run.append(state)
                continue
            if run:
                rows.append(self._answer_masks(run))
                run = []
            if state is None:
                break
            row = np.ones((1, self.vocab_size), dtype=bool)
            if state.phase != THINKING:
                forced = (
                    self.markers.start_tokens
                    if state.phase == OPENING
                    else self.markers.close_tokens
                )
                row[:] = False
                row[0, forced[state.matched]] = True
            rows.append(mx.array(row))
        return mx.concatenate(rows) if len(rows) > 1 else rows[0]

    def _answer_masks(self, run: list) -> mx.array:
        masks = (
            self.inner.masks([s.inner for s in run])
            if self.inner is not None
            else mx.ones((len(run), self.vocab_size), dtype=mx.bool_)
        )
        # the model may still open it
        if run[0].phase == START and self._opens(self.markers.start_tokens[0]):
            opening = mx.arange(self.vocab_size) == self.markers.start_tokens[0]
            masks = mx.concatenate([masks[:1] | opening, masks[1:]])
        return masks

    def advance(self, tokens: list):
        for i, token in enumerate(tokens):
            if self.state.phase == ANSWER or (self.state.phase == START and not self._opens(token)):
                self.state = ThinkState(ANSWER, self.state.spent)
                if self.inner is not None:
                    self.inner.advance(tokens[i:])
                return
            self.state = self._step(self.state, token)

    def forced_after(self, path: list) -> list:
        """In the answer, what its constraint forces after draft tokens ``path`` (inside the
        thinking block: nothing)."""
        if self.inner is None or self.state.phase != ANSWER:
            return []
        return self.inner.forced_after(path)

    def forced_tokens(self) -> list:
        """The marker tokens forced from here (the rest of the opening or of the closing text)."""
        if self.state.phase == OPENING:
            return list(self.markers.start_tokens[self.state.matched :])
        if self.state.phase == CLOSING:
            return list(self.markers.close_tokens[self.state.matched :])
        return []


class ThinkingForcedSource(DraftSource):
    """Drafts the text a ``ThinkingConstraint`` forces: the rest of a marker (the closing text once
    the budget is spent), then what the answer's constraint forces (``inner``, its forced-text
    source), all for free. In the answer it is ``inner``."""

    name = "thinking"

    def __init__(self, constraint: ThinkingConstraint, inner: Optional[DraftSource] = None):
        self.constraint, self.inner = constraint, inner
        # whether the inner source drafted this step, with nothing forced before it
        self.delegated = False

    def reset(self, sampling=Sampling(), processors=(), cost=None):
        super().reset(sampling, processors, cost)
        if self.inner is not None:
            self.inner.reset(sampling, processors, cost)

    def propose(self, tokens: list, max_draft: int, max_nodes=None) -> Optional[Draft]:
        phase = self.constraint.state.phase
        forced = self.constraint.forced_tokens()[:max_draft]
        self.delegated = False
        if self.inner is not None and phase in (START, ANSWER, CLOSING) and len(forced) < max_draft:
            follow = self.inner.propose(tokens + forced, max_draft - len(forced))
            self.delegated = not forced  # its update reads what it proposed at the draft's start
            forced += follow.tokens if follow is not None else []
        return Draft(forced) if forced else None

    def update(self, tokens: list, num_proposed: int, num_accepted: int) -> None:
        if self.inner is not None and self.delegated:
            self.inner.update(tokens, num_proposed, num_accepted)


def reasoning_token_count(tokens: list, markers: ThinkMarkers, phase: str) -> int:
    """How many of the generated ``tokens`` lie inside the think block (markers and separator
    aside), for usage's ``reasoning_tokens``; ``phase``: where the prompt left the model."""
    if phase == ANSWER:
        return 0
    begin = 0
    if phase == START:
        opened = next(
            (
                i
                for i in range(len(tokens))
                if tuple(tokens[i : i + len(markers.start_tokens)]) == markers.start_tokens
            ),
            -1,
        )
        if opened < 0:
            return 0
        begin = opened + len(markers.start_tokens)
    end = next(
        (
            i
            for i in range(begin, len(tokens))
            if tuple(tokens[i : i + len(markers.end_tokens)]) == markers.end_tokens
        ),
        len(tokens),
    )
    return end - begin


class ReasoningSplitter:
    """Streamed text (its markers as text: special tokens decoded) -> ``("reasoning", text)`` and
    ``("text", text)`` pieces, split at the think markers. Whitespace around the reasoning and
    before the answer is dropped; text that may be the start of a marker is held back until it
    cannot be."""

    def __init__(self, markers: Optional[ThinkMarkers], phase: str = ANSWER):
        self.markers = markers
        self.phase = ANSWER if markers is None else phase
        self.held = ""
        self.started = False  # reasoning shown yet
        self.after_block = False  # the answer follows a block: its leading whitespace is dropped

    def add(self, piece: str) -> list:
        self.held += piece
        out = []
        if self.phase == START:
            text = self.held.lstrip()
            if text.startswith(self.markers.start):
                self.phase, self.held = THINKING, text[len(self.markers.start) :]
            elif self.markers.start.startswith(text):
                return out  # still may open the block
            else:
                self.phase = ANSWER
        if self.phase == THINKING:
            index = self.held.find(self.markers.end)
            if index < 0:
                end = self.markers.end
                keep = max(
                    (k for k in range(1, len(end)) if self.held.endswith(end[:k])), default=0
                )
                return self._reasoning(len(self.held) - keep)
            text, rest = self.held[:index], self.held[index + len(self.markers.end) :]
            self.held = text
            out += self._reasoning(len(text), closing=True)
            self.phase, self.held, self.after_block = ANSWER, rest, True
        # the separator (whitespace, or harmony's final-channel header) is no answer
        if self.after_block:
            separator = self.markers.separator.strip()
            self.held = self.held.lstrip()
            if separator and self.held.startswith(separator):
                self.held = self.held[len(separator) :].lstrip()
            elif separator and separator.startswith(self.held):
                return out  # may still be the separator
            self.after_block = not self.held
        if self.held:
            out.append(("text", self.held))
            self.held = ""
        return out

    def _reasoning(self, cut: int, closing: bool = False) -> list:
        """Show ``held[:cut]`` as reasoning, less the whitespace at its start and (held back) at its
        end."""
        body = self.held[:cut]
        if not self.started:
            body = body.lstrip()
            self.held = self.held[cut - len(body) :]
            cut = len(body)
        shown = body.rstrip()
        self.held = "" if closing else self.held[len(shown) :]
        self.started = self.started or bool(shown)
        return [("reasoning", shown)] if shown else []

    def finish(self) -> list:
        """What is held at the end: unfinished reasoning (cut by max_tokens), or answer text."""
        if self.phase == THINKING:
            return self._reasoning(len(self.held), closing=True)
        text, self.held = (self.held.lstrip() if self.after_block else self.held), ""
        if self.after_block and self.markers.separator.strip().startswith(text):
            text = ""  # a separator cut short
        return [("text", text)] if text else []


def split_reasoning(text: str, markers: Optional[ThinkMarkers], phase: str = START) -> tuple:
    """``(reasoning, answer)`` of a whole output; ``phase``: where the prompt left the model."""
    splitter = ReasoningSplitter(markers, phase)
    pieces = splitter.add(text) + splitter.finish()
    return (
        "".join(t for kind, t in pieces if kind == "reasoning"),
        "".join(t for kind, t in pieces if kind == "text"),
    )


@dataclass(frozen=True)
class Thinking:
    """A thinking model's prompt: its markers, where the prompt leaves the model (START, THINKING or
    ANSWER) and the block's budget (None: none; 0: the block never opens, or closes at once)."""

    markers: ThinkMarkers
    phase: str
    budget: Optional[int] = None

    def around(self, constraint, forced, vocab_size: int) -> tuple:
        """``(constraint, forced)`` put after the think block, with the budget; as they are where
        the prompt left the block already or nothing bounds it or follows it (no cost then)."""
        if self.phase == ANSWER or (constraint is None and self.budget is None):
            return constraint, forced
        wrapped = ThinkingConstraint(self.markers, vocab_size, constraint, self.budget, self.phase)
        return wrapped, ThinkingForcedSource(wrapped, forced)

    def reasoning_tokens(self, tokens: list) -> int:
        return reasoning_token_count(tokens, self.markers, self.phase)

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.markers, self.phase)

    def split(self, text: str) -> tuple:
        """``(reasoning, answer)`` of a whole output."""
        return split_reasoning(text, self.markers, self.phase)


def thinking_of(tokenizer, prompt: list, budget: Optional[int] = None) -> Optional[Thinking]:
    """The ``Thinking`` of a rendered ``prompt``, or None for a model without think markers (it
    answers as it is). ``budget`` 0 turns thinking off where the template still opened the block
    (or may let the model open it)."""
    markers = think_markers(tokenizer)
    if markers is None:
        return None
    return Thinking(markers, markers.phase(prompt, tokenizer.decode), budget)
