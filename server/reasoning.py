"""Reasoning in every API: what a request asks of the think block, and the answer's text split from
it.

Each API says it its own way (chat: ``reasoning_effort``, ``thinking_token_budget``,
``chat_template_kwargs``; Responses: ``reasoning.effort``; Messages: ``thinking`` and
``output_config.effort``); each becomes a ``ThinkingRequest``, and ``constrained.thinking.Thinking``
(``thinking_of``, as in main.py) is what the engine and the formats need once the prompt is
rendered. Effort levels map to budgets through ``EFFORT_BUDGETS``
(``python -m server --effort-budgets`` changes it). A budget bounds the tokens inside the block; the
block's closing text is then forced (constrained/thinking.py). Reasoning counts against max_tokens,
as in Anthropic's API.
"""

from dataclasses import dataclass, field
from typing import Optional

from constrained.think_markers import think_markers

# Effort -> the most tokens inside the think block (None: unbounded). "none" turns thinking off.
EFFORT_BUDGETS = {
    "minimal": 256,
    "low": 1024,
    "medium": 4096,
    "high": 16384,
    "xhigh": 32768,
    "max": None,
}


def parse_effort_budgets(text: str, table: Optional[dict] = None) -> dict:
    """``"low=512,high=8192"`` over ``table`` (default EFFORT_BUDGETS); ``none`` as a value:
    unbounded. ValueError names a bad entry."""
    budgets = dict(EFFORT_BUDGETS if table is None else table)
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = entry.partition("=")
        name, value = name.strip(), value.strip()
        if not name or name == "none" or not value:
            raise ValueError(
                f"'{entry}': give effort=tokens, e.g. low=512 "
                "(the effort 'none' turns thinking off)"
            )
        if value.lower() == "none":
            budgets[name] = None
        elif value.isdigit() and int(value) > 0:
            budgets[name] = int(value)
        else:
            raise ValueError(f"'{entry}': the budget must be a positive number of tokens or 'none'")
    return budgets


@dataclass
class ThinkingRequest:
    """What a request asks: thinking on (True), off (False) or as the template has it (None), a
    budget (None: none), and options for the chat template (``chat_template_kwargs``)."""

    enabled: Optional[bool] = None
    budget: Optional[int] = None
    template_options: dict = field(default_factory=dict)

    def block_budget(self) -> Optional[int]:
        """The think block's budget: 0 with thinking off, as the template may still open the
        block (or let the model open it), which then closes at once or never opens."""
        return 0 if self.enabled is False else self.budget


def template_options(asked: ThinkingRequest, tokenizer) -> dict:
    """Options for the chat template: the request's own, and ``enable_thinking`` when it says on or
    off (mlx-lm's wrapper passes it under the name the template reads)."""
    options = dict(asked.template_options)
    if asked.enabled is not None and think_markers(tokenizer) is not None:
        options.setdefault("enable_thinking", asked.enabled)
    return options
