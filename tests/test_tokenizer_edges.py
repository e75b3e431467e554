"""Tokenizer edge cases: a chat without a chat template, text that stops inside a character, a regex
that starts with a space on a SentencePiece tokenizer, and ``\\r\\n``."""

from constrained.build import regex_constraint
from decoder import Sampling, TextStream, encode, generate, plain_chat
from server.anthropic_input import parse_messages
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
    request = parse_messages(
        {
            "model": "tiny",
            "max_tokens": 4,
            "system": "Be brief.",
            "messages": [{"role": "user", "content": "hi"}],
        },
        tokenizer,
        "tiny",
        8,
    )
    assert tokenizer.decode(request.prompt) == plain_chat(messages)
    assert encode(tokenizer, "hi") == tokenizer.encode("hi")  # a str stays raw text


def test_streamed_text_is_the_decode_of_the_tokens_once_the_stream_ends():
    """Cut inside a two-byte character: the stream still gives what decode shows (a replacement
    character)."""
    tokenizer = tiny_server.tokenizer()
    # one token per byte: C3 A9 C3 A9 C3 A9
    constraint, _ = regex_constraint("ééé", tokenizer, VOCAB)
    for max_tokens, text in ((3, "é\ufffd"), (5, "éé\ufffd"), (6, "ééé")):
        result = generate(MODEL, tokenizer, [10, 11], constraint=constraint, max_tokens=max_tokens)
        assert result.text == tokenizer.decode(result.tokens) == text
    stream = TextStream(tokenizer)
    tokens = tokenizer.encode("aé", add_special_tokens=False)[:-1]
    assert "".join(stream.add(t) for t in tokens) + stream.finish() == tokenizer.decode(tokens)


def sentencepiece_tokenizer():
    """A Llama 2-style SentencePiece tokenizer: "▁" for spaces, one prepended to the text, byte
    fallback, and a decoder that strips the first space again."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁w", "▁wi", "▁wire", "▁x", "\r", "\n"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "w"), ("▁w", "i"), ("▁wi", "re"), ("r", "e"), ("▁", "x")]
    vocab.setdefault("re", len(vocab))
    tokenizer = Tokenizer(
        models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.pre_tokenizer = None
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ["<unk>", "<s>", "</s>"]])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="</s>", bos_token="<s>", unk_token="<unk>"
    )


def test_a_regex_with_a_leading_space_holds_on_sentencepiece():
    """`--regex ' [a-z]{3,8}'` printed `wireuppq`: the first "▁" was counted as the space, and
    decode drops it."""
    from tests.helpers import tiny_llama

    tokenizer = sentencepiece_tokenizer()
    wire = tokenizer.convert_tokens_to_ids("▁wire")
    assert tokenizer.decode([wire]) == "wire"  # the decoder strips the first space
    vocab = len(tokenizer)
    model = tiny_llama(vocab_size=vocab, seed=1)
    for pattern in (r" [a-z]{3,8}", r"[a-z]{3,8}", r" ?x+"):
        constraint, forced = regex_constraint(pattern, tokenizer, vocab)
        for seed in range(3):
            import re

            import mlx.core as mx

            mx.random.seed(seed)
            result = generate(
                model,
                tokenizer,
                [1, 5],
                constraint=constraint,
                draft_sources=[forced],
                sampling=Sampling(1.0),
                max_tokens=20,
            )
            text = tokenizer.decode([t for t in result.tokens if t != tokenizer.eos_token_id])
            assert re.fullmatch(pattern, text), (pattern, text)
    constraint, _ = regex_constraint(r" [a-z]{3,8}", tokenizer, vocab)
    # "▁wire" alone decodes without the space
    assert not constraint.masks(constraint.walk([]))[0].tolist()[wire]
