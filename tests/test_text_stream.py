"""TextStream: streamed segments add up to the tokenizer's own decode of the tokens."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decoder import TextStream, generate
from t5 import T5Tokenizer
from tests.t5_fixtures import train_tiny_spiece


def stream(tokenizer, tokens):
    text = TextStream(tokenizer)
    return [text.add(token) for token in tokens]


def check(tokenizer, tokens):
    segments = stream(tokenizer, tokens)
    full = tokenizer.decode(tokens)
    joined = "".join(segments)
    # A trailing partial character is held back; everything before it is printed exactly.
    assert joined == full.rstrip("\ufffd") or (full.endswith("\ufffd") and full.startswith(joined))
    assert not any(segment.endswith("\ufffd") for segment in segments)


@pytest.fixture(scope="module")
def byte_tokens(embedded):
    """SmolLM2 tokens that are lone bytes of multi-byte characters (they decode to "\ufffd")."""
    _, tokenizer, _ = embedded
    return [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == "\ufffd"]


TRICKY = [
    "héllo wörld",
    "日本語のテキスト",
    "emoji 🤖🎉 mixed",
    "a\u0301 combining",
    " leading  spaces ",
    "don't it's",
    "tabs\tand\nnewlines\n\n",
    "Ωμέγα",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.mark.parametrize("text", TRICKY)
def test_real_tokenizer_on_tricky_text(embedded, text):
    _, tokenizer, _ = embedded
    check(tokenizer, tokenizer.encode(text, add_special_tokens=False))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_real_tokenizer_on_random_tokens_and_split_characters(embedded, byte_tokens, data):
    _, tokenizer, _ = embedded
    token = st.one_of(st.integers(0, tokenizer.vocab_size - 1), st.sampled_from(byte_tokens))
    check(tokenizer, data.draw(st.lists(token, max_size=40)))


def test_t5_sentencepiece_tokenizer(tmp_path):
    tokenizer = T5Tokenizer(train_tiny_spiece(tmp_path / "spiece.model"))
    for text in TRICKY + ["the cat sat on the mat. the dog ran."]:
        check(tokenizer, tokenizer.encode(text)[:-1])  # without </s>


def test_generated_text_is_the_decoded_tokens(embedded, chat_prompt):
    model, tokenizer, _ = embedded
    prompt = chat_prompt('Repeat this exactly: "Où est la bibliothèque? Ça coûte 5 €. 東京 🎉"')
    result = generate(model, tokenizer, prompt, max_tokens=40)
    tokens = [t for t in result.tokens if t not in tokenizer.eos_token_ids]
    assert result.text == tokenizer.decode(tokens).rstrip("\ufffd")
    assert any(ord(ch) > 127 for ch in result.text)  # the prompt did exercise multi-byte text
