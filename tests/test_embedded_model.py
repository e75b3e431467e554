"""The embedded SmolLM2-135M-Instruct: a golden answer, parity with mlx-lm, the converter."""

from mlx_lm import stream_generate as mlx_lm_stream_generate

from decoder import generate

QUESTION = "What is the capital of France? Answer in one sentence."


def test_answers_the_fixed_question(embedded, chat_prompt):
    model, tokenizer, _ = embedded
    result = generate(model, tokenizer, chat_prompt(QUESTION), max_tokens=40)
    assert result.text == "The capital of France is Paris."
    assert result.finish_reason == "stop"
    assert result.stats.target_forward_passes == result.generation_tokens


def test_greedy_tokens_equal_mlx_lm_generate(embedded, chat_prompt):
    # (QUESTION's answer is checked word for word above.)
    model, tokenizer, _ = embedded
    prompt = chat_prompt("Write a haiku about autumn leaves.")
    ours = generate(model, tokenizer, prompt, max_tokens=48).tokens
    theirs = [r.token for r in mlx_lm_stream_generate(model, tokenizer, prompt, max_tokens=48)]
    assert ours == theirs


def test_gguf_tokenizer_round_trips_text_and_splits_digits(embedded):
    _, tokenizer, _ = embedded
    text = "Héllo wörld 🙂 12345\n\tdef f(x): return x"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode("2024") == [tokenizer.encode(d)[0] for d in "2024"]


def test_converted_directory_is_a_standard_mlx_lm_model(embedded):
    import json

    _, _, path = embedded
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())


def test_num_layers_makes_an_early_exit_draft(tmp_path):
    import mlx.core as mx
    from mlx_lm import load

    from loading.conversion import convert
    from loading.load import embedded_gguf

    out = convert(str(tmp_path / "draft"), gguf=str(embedded_gguf()), num_layers=4)
    model, tokenizer = load(str(out))
    assert len(model.layers) == 4
    logits = model(mx.array([tokenizer.encode("Hello")]))
    assert logits.shape[-1] == 49152


def test_hf_path_conversion_with_quantization(embedded, tmp_path):
    """convert.py --hf-path on an mlx-lm/Hugging Face directory, cast and quantized: a tiny Llama
    with the embedded model's tokenizer (the path is the same for any size; the embedded model's
    would spend most of the test in MLX's slow quantized CPU kernels)."""
    import mlx.core as mx
    from mlx_lm import load

    from loading.conversion import convert
    from tests.architectures import build, save

    model, config = build("llama")
    path = save(tmp_path / "tiny", model, config)
    out = convert(str(tmp_path / "q8"), hf_path=str(path), dtype="float16", quantize=True, q_bits=8)
    quantized, tokenizer = load(str(out))
    assert quantized.layers[0].self_attn.q_proj.bits == 8
    inputs = mx.array([tokenizer.encode("The capital of France is")])
    assert mx.argmax(quantized(inputs)[0, -1]).item() == mx.argmax(model(inputs)[0, -1]).item()


def test_prompt_lookup_is_lossless_on_the_embedded_model(embedded, chat_prompt):
    from prompt_lookup import PromptLookupSource

    model, tokenizer, _ = embedded
    document = (
        "Repeat this list exactly: apples, pears, plums, cherries, apricots, peaches, grapes, "
        "lemons, limes, oranges."
    )
    prompt = chat_prompt(document)
    plain = generate(model, tokenizer, prompt, max_tokens=40)
    fast = generate(model, tokenizer, prompt, max_tokens=40, draft_sources=[PromptLookupSource()])
    assert fast.tokens == plain.tokens
    assert fast.stats.target_forward_passes < plain.stats.target_forward_passes / 2
