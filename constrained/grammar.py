"""Context-free constraints for the shared loop: Lark, GBNF and full JSON Schema through llguidance.

The regex path (regex_dfa.py -> token_index.py -> constraint.py) is written by hand because it is
the point of the example; a grammar engine is not, so here the best-kept one does the work:
llguidance (``pip install llguidance``, MIT; imported where it is used), an Earley parser over a
lazy regex lexer. This file adapts it to the loop's ``Constraint`` protocol, with the text it
forces, and names the draft source of that text.

    constraint = GrammarConstraint.from_grammar('start: "yes" | "no"', tokenizer, vocab_size)
    result = generate(model, tokenizer, prompt, constraint=constraint,
                      draft_sources=[GrammarForcedSource(constraint)])
"""

import re
from copy import copy
from typing import Optional

import mlx.core as mx
import numpy as np

from constrained.constraint import ForcedSource, TokenSplits, tokenize_forced
from decoder.draft import Constraint, ConstraintError
from decoder.text import eos_ids_of

# Compact JSON, like the built-in schema compiler: separators are forced text, so they cost no model
# step.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GrammarError(ValueError):
    """The engine refused a grammar or schema (its message is quoted on one line), or it is not
    installed."""


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GrammarError("grammars need the llguidance package: pip install llguidance") from None
    return llguidance


def _one_line(message: str, limit: int = 300) -> str:
    # not the parser state dump that may follow
    message = " ".join(message.split("<state>")[0].split())
    return message if len(message) <= limit else message[: limit - 3] + "..."


def compile_grammar(text: str, grammar_format: str = "auto", ll_tokenizer=None) -> str:
    """A Lark (llguidance's dialect) or GBNF grammar -> llguidance's grammar string; GrammarError
    quotes the engine's refusal. Without ``ll_tokenizer`` this checks the grammar alone (fast:
    before a model loads)."""
    llguidance = _llguidance()
    # GBNF (llama.cpp) writes rules as ``name ::= ...``; Lark ``name: ...``
    if grammar_format == "auto":
        grammar_format = "gbnf" if re.search(r"(?m)^\s*[A-Za-z][\w-]*\s*::=", text) else "lark"
    if grammar_format != "lark":  # GBNF goes through llguidance's own converter
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as error:  # noqa: BLE001 - the converter raises plain exceptions for bad input
            raise GrammarError(
                f"cannot convert the GBNF grammar: {_one_line(str(error))}"
            ) from None
    return _checked(llguidance.LLMatcher.grammar_from_lark(text), ll_tokenizer, "the grammar")


def compile_json_schema(schema, ll_tokenizer=None, **options) -> str:
    """A JSON Schema (dict or JSON text) -> llguidance's grammar string for compact JSON that
    validates."""
    llguidance = _llguidance()
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, overrides={**JSON_OPTIONS, **options}
        )
    except ValueError as error:  # not a JSON object (e.g. `true`)
        raise GrammarError(f"llguidance refused the schema: {_one_line(str(error))}") from None
    return _checked(grammar, ll_tokenizer, "the schema")


def _checked(grammar: str, ll_tokenizer, what: str) -> str:
    is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(
        grammar, ll_tokenizer
    )
    if is_error:
        raise GrammarError(f"llguidance refused {what}: {_one_line(messages[0])}")
    return grammar


# id(backend tokenizer) -> (backend, LLTokenizer): building one reads the whole vocabulary
_LL_TOKENIZERS = {}


def ll_tokenizer_of(tokenizer):
    """The ``llguidance.LLTokenizer`` for a Hugging Face fast tokenizer or an mlx-lm
    TokenizerWrapper."""
    llguidance = _llguidance()
    # mlx-lm's wrapper forwards to the HF tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GrammarError(
            "grammars need a Hugging Face fast tokenizer (tokenizer.json); T5 is not supported"
        )
    cached = _LL_TOKENIZERS.get(id(backend))
    if cached is None or cached[0] is not backend:
        serializable = copy(backend)
        serializable.no_padding()
        serializable.no_truncation()
        eos = sorted(eos_ids_of(tokenizer))
        cached = _LL_TOKENIZERS[id(backend)] = (
            backend,
            llguidance.LLTokenizer(serializable.to_str(), eos_token=eos),
        )
    return cached[1]


class GrammarConstraint(Constraint):
    """An llguidance matcher behind the loop's ``walk / masks / advance`` protocol. The matcher
    holds the accepted text. A walk asks it how many draft tokens are valid (``validate_tokens``, no
    state change); ``masks`` consumes them one at a time, writes the bitmask before each, and rolls
    them back, so the matcher is exactly where it was. States are the draft prefixes themselves
    (tuples), so ``masks(walk(draft))`` needs nothing else. EOS is allowed exactly when the matcher
    accepts; after an EOS in a draft only EOS is. ``splits``: how the model writes forced text
    (``TokenSplits``, shared across rows); None: no forced text."""

    def __init__(
        self, matcher, ll_tokenizer, vocab_size: int, splits: Optional[TokenSplits] = None
    ):
        # The lexer is built lazily under resource limits ("too many expressions constructed"): if
        # even the first mask is past them, say so now rather than at the first step.
        if not matcher.is_error():
            matcher.compute_bitmask()
        if matcher.is_error():
            raise GrammarError(f"llguidance refused the grammar: {_one_line(matcher.get_error())}")
        self.matcher, self.splits = matcher, splits
        # the logits' width; may exceed the tokenizer's (padded with False)
        self.vocab_size = vocab_size
        self.num_tokens = ll_tokenizer.vocab_size
        self.eos_token_ids = set(ll_tokenizer.eos_tokens)
        # 32 tokens per int32 word of llguidance's bitmask
        self._words = (self.num_tokens + 31) // 32

    @classmethod
    def from_llguidance(
        cls, grammar: str, tokenizer, vocab_size: int, splits: Optional[TokenSplits] = None
    ) -> "GrammarConstraint":
        """From a compiled grammar string (``compile_grammar`` / ``compile_json_schema``)."""
        ll_tokenizer = ll_tokenizer_of(tokenizer)
        matcher = _llguidance().LLMatcher(ll_tokenizer, grammar)
        splits = splits if splits is not None else TokenSplits(tokenizer)
        return cls(matcher, ll_tokenizer, vocab_size, splits)

    @classmethod
    def from_grammar(cls, text: str, tokenizer, vocab_size: int, grammar_format: str = "auto"):
        """Output in the language of a Lark (llguidance dialect) or GBNF grammar."""
        grammar = compile_grammar(text, grammar_format, ll_tokenizer_of(tokenizer))
        return cls.from_llguidance(grammar, tokenizer, vocab_size)

    @classmethod
    def from_json_schema(cls, schema, tokenizer, vocab_size: int, **options) -> "GrammarConstraint":
        """Compact JSON valid under ``schema``; ``options`` override llguidance's JSON settings."""
        grammar = compile_json_schema(schema, ll_tokenizer_of(tokenizer), **options)
        return cls.from_llguidance(grammar, tokenizer, vocab_size)

    def reset(self):
        self.matcher.reset()

    def walk(self, draft: list) -> list:
        """The allowed draft prefixes, as tuples of tokens: the grammar's state is the matcher's
        after the accepted text plus a prefix."""
        # Ids past the tokenizer's vocabulary (a wider draft model) would put the matcher in an
        # error state.
        in_vocab = next(
            (i for i, token in enumerate(draft) if not 0 <= token < self.num_tokens), len(draft)
        )
        num_valid = self.matcher.validate_tokens(draft[:in_vocab]) if in_vocab else 0
        return [tuple(draft[:length]) for length in range(num_valid + 1)]

    def masks(self, states: list) -> mx.array:
        """(len(states), vocab) bool: the tokens allowed after each prefix."""
        draft = states[-1]
        bitmask = np.zeros((len(states), self._words), dtype=np.int32)
        # After an EOS in the draft only EOS may follow. EOS is not consumed: a matcher that had
        # already stopped does not count it, so rolling it back would not be exact.
        stop = next(
            (i + 1 for i, token in enumerate(draft) if token in self.eos_token_ids), len(states)
        )
        consumed = 0
        try:
            for position, row in enumerate(bitmask[:stop]):
                if position:
                    self.matcher.consume_token(draft[position - 1])
                    consumed += 1
                self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        finally:
            self.matcher.rollback(consumed)  # exact: back to the accepted text
        if self.matcher.is_error():
            raise ConstraintError(
                f"the grammar engine failed: {_one_line(self.matcher.get_error())}"
            )
        # One bit per token, little-endian within each word -> one bool per token, padded to the
        # logits' width.
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        allowed = np.zeros((len(states), self.vocab_size), dtype=bool)
        width = min(self.num_tokens, self.vocab_size)
        allowed[:, :width] = bits[:, :width]
        allowed[stop:, list(self.eos_token_ids)] = True
        return mx.array(allowed)

    def advance(self, tokens: list):
        if not self.matcher.consume_tokens(list(tokens)):
            raise ConstraintError(
                f"the grammar engine rejected an accepted token: "
                f"{_one_line(self.matcher.get_error())}"
            )

    def forced_after(self, path: list, previous: Optional[int] = None) -> list:
        """The text the grammar forces after draft tokens ``path`` ([] where it refuses them or
        they hold EOS), as the model writes it after ``path``'s last token (of an empty path:
        ``previous``). llguidance's ``compute_ff_bytes`` gives the forced bytes; the matcher takes
        ``path`` and goes back. (``compute_ff_tokens`` stops before any token a longer one could
        still replace, e.g. before ``":"`` when ``":""`` exists, so it drafts less.)"""
        if self.splits is None or len(self.walk(path)) <= len(path):
            return []
        if self.eos_token_ids & set(path):
            return []
        if not path:
            forced = self.matcher.compute_ff_bytes()
        else:
            self.matcher.consume_tokens(list(path))
            try:
                forced = self.matcher.compute_ff_bytes()
            finally:
                self.matcher.rollback(len(path))
        return self.splits.apply(
            tokenize_forced(self.splits.tokenizer, forced), path[-1] if path else previous
        )


class GrammarForcedSource(ForcedSource):
    """Drafts the text a ``GrammarConstraint`` forces next (``{"name":"`` in a JSON shape) at no
    model cost."""

    name = "grammar"
