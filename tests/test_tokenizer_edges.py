"""Tokenizer edge cases: a chat without a chat template, text that stops inside a character, a regex
that starts with a space on a SentencePiece tokenizer, and ``\\r\\n``."""

import pytest

from constrained.build import regex_constraint
from decoder import TextStream, encode, generate, plain_chat
from server.anthropic import parse_messages
from server.protocol import parse_chat
from tests import tiny_server
from tests.helpers import tiny_byte_tokenizer

MODEL = tiny_server.model()
VOCAB = tiny_server.vocab_size()


def no_template():
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return TokenizerWrapper(tiny_byte_tokenizer())


def test_a_chat_without_a_template_is_rendered_plainly():
    """As mlx_lm.server does, rather than a 400 for every chat and Messages request."""
    tokenizer = no_template()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert plain_chat(messages) == "ASSISTANT's RULE: Be brief.\nUSER: hi\nASSISTANT:"
    assert encode(tokenizer, messages) == tokenizer.encode(plain_chat(messages))
    request = parse_chat({"model": "tiny", "messages": messages}, tokenizer, "tiny", 8)
    assert tokenizer.decode(request.prompt) == plain_chat(messages)
    request = parse_messages({"model": "tiny", "max_tokens": 4, "system": "Be brief.",
                              "messages": [{"role": "user", "content": "hi"}]}, tokenizer, "tiny", 8)
    assert tokenizer.decode(request.prompt) == plain_chat(messages)
    assert encode(tokenizer, "hi") == tokenizer.encode("hi")  # a str stays raw text


def test_streamed_text_is_the_decode_of_the_tokens_once_the_stream_ends():
    """Cut inside a two-byte character: the stream still gives what decode shows (a replacement character)."""
    tokenizer = tiny_server.tokenizer()
    constraint, _ = regex_constraint("ééé", tokenizer, VOCAB)  # one token per byte: C3 A9 C3 A9 C3 A9
    for max_tokens, text in ((3, "é\ufffd"), (5, "éé\ufffd"), (6, "ééé")):
        result = generate(MODEL, tokenizer, [10, 11], constraint=constraint, max_tokens=max_tokens)
        assert result.text == tokenizer.decode(result.tokens) == text
    stream = TextStream(tokenizer)
    tokens = tokenizer.encode("aé", add_special_tokens=False)[:-1]
    assert "".join(stream.add(t) for t in tokens) + stream.finish() == tokenizer.decode(tokens)
