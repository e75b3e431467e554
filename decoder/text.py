"""Text in and out of the loop: prompts to token ids (``encode``), tokens to text segments
(``TextStream``), and what a tokenizer says about the output (``eos_ids_of``, ``output_size``)."""

from typing import Optional, Sequence, Union


def eos_ids_of(tokenizer) -> set:
    """The ids that end generation: mlx-lm's wrapper has a set, other tokenizers one id."""
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    return {ids} if isinstance(ids, int) else set(ids)


def output_size(model, tokenizer) -> int:
    """The width of the model's logits (its config's vocab_size, else the tokenizer's size)."""
    args = getattr(model, "args", None)
    return getattr(args, "vocab_size", None) or len(tokenizer.get_vocab())


class TextStream:
    """Text segments for a growing list of tokens, in constant time per token: decode the last
    segment's tokens plus the new ones and keep what the new ones add (the old ones give them a
    leading space or the rest of a character). Any tokenizer with ``decode(ids) -> str`` works."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens = []
        self.window_start = 0  # first token of the last printed segment
        self.printed_end = 0  # tokens before this are printed

    def add(self, token: int) -> str:
        """The text ``token`` completes ("" while a character is still partial)."""
        self.tokens.append(token)
        window = self.tokens[self.window_start :]
        text = self.tokenizer.decode(window)
        if text.endswith("\ufffd"):
            return ""
        printed = self.tokenizer.decode(window[: self.printed_end - self.window_start])
        self.window_start, self.printed_end = self.printed_end, len(self.tokens)
        return text[len(printed) :]

    def finish(self) -> str:
        """The text still held at the end, so that the segments add up to ``decode(tokens)``."""
        if self.printed_end == len(self.tokens):
            return ""
        window = self.tokens[self.window_start :]
        text = self.tokenizer.decode(window)
        printed = self.tokenizer.decode(window[: self.printed_end - self.window_start])
        self.window_start = self.printed_end = len(self.tokens)
        return text[len(printed) :]


def encode(
    tokenizer,
    prompt: Union[str, Sequence[int], Sequence[dict]],
    system: Optional[str] = None,
    **template_options,
) -> list:
    """Token ids for a str, chat messages or token ids: the one place a chat template is applied
    (to a str too, as mlx-lm's CLI does). ``system`` goes first; ``template_options`` (e.g.
    ``tools=``) go to the template."""
    if isinstance(prompt, str):
        if not has_chat_template(tokenizer):
            return tokenizer.encode(prompt)
        prompt = [{"role": "user", "content": prompt}]
    elif not (
        isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], dict)
    ):
        return list(prompt)  # token ids
    messages = ([{"role": "system", "content": system}] if system else []) + list(prompt)
    if not has_chat_template(tokenizer):
        return tokenizer.encode(plain_chat(messages))
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_options)


def has_chat_template(tokenizer) -> bool:
    """Whether ``apply_chat_template`` has a template (T5's tokenizer has neither attribute)."""
    return bool(
        getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None)
    )


# Roles as mlx_lm.server writes a chat for a tokenizer without a chat template.
PLAIN_ROLES = {"system": "ASSISTANT's RULE: ", "user": "USER: ", "assistant": "ASSISTANT: "}


def plain_chat(messages: Sequence[dict]) -> str:
    """Chat messages as plain text for a tokenizer without a template, as mlx_lm.server writes
    them."""
    lines = "".join(f"{PLAIN_ROLES.get(m['role'], '')}{m.get('content') or ''}\n" for m in messages)
    return (lines + PLAIN_ROLES["assistant"]).rstrip()
