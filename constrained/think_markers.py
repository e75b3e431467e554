"""A thinking model's think block as its tokenizer writes it: the markers and the separator after
them, read per tokenizer (``think_markers``), and where a rendered prompt leaves the model
(``ThinkMarkers.phase``: START, THINKING or ANSWER, three of the phases of thinking.py's
``ThinkingConstraint``, which bounds the block).
"""

import functools
from dataclasses import dataclass
from typing import Optional

START, OPENING, THINKING, CLOSING, ANSWER = "start", "opening", "thinking", "closing", "answer"


@dataclass(frozen=True)
class ThinkMarkers:
    """The think block's markers, as text and as token ids, and the separator written after it."""

    start: str
    end: str
    start_tokens: tuple
    end_tokens: tuple
    # what the template writes between the block and the answer ("\n\n")
    separator_tokens: tuple = ()
    separator: str = ""  # the same as text

    @property
    def close_tokens(self) -> tuple:
        """The closing text a budget forces: the end marker, then the separator."""
        return self.end_tokens + self.separator_tokens

    def phase(self, prompt: list, decode) -> str:
        """Where the prompt leaves the model: THINKING where the template opened the block (only
        whitespace after the last opening marker), ANSWER where it wrote a closed block last
        (thinking turned off), else START. ``decode``: the tokenizer's, for the text after the
        marker."""
        opened, closed = _rfind(prompt, self.start_tokens), _rfind(prompt, self.end_tokens)
        if opened > closed and not decode(prompt[opened + len(self.start_tokens) :]).strip():
            return THINKING
        tail_after_close = prompt[closed + len(self.end_tokens) :] if closed >= 0 else None
        if closed > opened >= 0 and not decode(tail_after_close).strip():
            return ANSWER
        return START


def _rfind(tokens: list, sequence: tuple) -> int:
    for i in range(len(tokens) - len(sequence), -1, -1):
        if tuple(tokens[i : i + len(sequence)]) == sequence:
            return i
    return -1


# GPT-OSS's harmony format: the analysis channel is the reasoning, the final channel the answer.
HARMONY = (
    "<|channel|>analysis<|message|>",
    "<|end|>",
    "<|start|>assistant<|channel|>final<|message|>",
)


@functools.lru_cache(maxsize=8)  # asked for every request; a tokenizer's markers never change
def think_markers(tokenizer) -> Optional[ThinkMarkers]:
    """The markers of a tokenizer that thinks, or None. mlx-lm's ``TokenizerWrapper`` finds them in
    the vocabulary (``<think>``, ``<longcat_think>``, Gemma's ``<|channel>thought``, ...); the
    separator is read from the chat template (Qwen3 and DeepSeek write ``</think>\\n\\n``). A
    harmony template (GPT-OSS) thinks in its analysis channel and answers in its final channel
    (HARMONY)."""
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    # a plain Hugging Face tokenizer has no such attribute
    if getattr(tokenizer, "has_thinking", False):
        start, end = tokenizer.think_start, tokenizer.think_end
        separator = next(
            (
                sep
                for sep in ("\n\n", "\n")
                if end + sep in template or end + sep.replace("\n", "\\n") in template
            ),
            "",
        )
    elif (
        "<|channel|>" in template
        and "analysis" in template
        and "<|channel|>" in tokenizer.get_vocab()
    ):
        start, end, separator = HARMONY
    else:
        return None
    encode = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ()  # noqa: E731
    return ThinkMarkers(start, end, encode(start), encode(end), encode(separator), separator)
