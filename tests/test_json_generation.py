"""JSON Schema constrained generation end to end: outputs validate, forced drafts stay lossless."""

import json

import jsonschema
import mlx.core as mx
import pytest

from constrained import ForcedTextSource, RegexConstraint
from decoder import DecodingStats, Sampling, generate
from tests.helpers import tiny_byte_tokenizer, tiny_llama
from tests.test_cli import assert_one_line_error, cli

TOKENIZER = tiny_byte_tokenizer()
MODEL = tiny_llama(vocab_size=len(TOKENIZER), num_layers=2, hidden_size=32, seed=3, sharp=3.0)
# Bounded strings and arrays: every walk ends, so a random model reaches EOS.
TINY_SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "admin": {"type": "boolean"},
        },
        "required": ["name", "age"],
    },
    {"type": "array", "items": {"enum": ["red", "green", 7, None]}, "minItems": 1, "maxItems": 3},
    {
        "oneOf": [
            {
                "type": "object",
                "properties": {
                    "op": {"const": "add"},
                    "x": {"type": "integer", "maximum": 99, "minimum": -9},
                },
                "required": ["op", "x"],
            },
            {
                "type": "object",
                "properties": {"op": {"const": "date"}, "d": {"type": "string", "format": "date"}},
                "required": ["op", "d"],
            },
        ]
    },
]


def validate(schema, text):
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    jsonschema.Draft202012Validator(schema, format_checker=checker).validate(json.loads(text))


def run(schema, prompt, model, tokenizer, forced, max_tokens, **kwargs):
    constraint = RegexConstraint.from_json_schema(
        schema, tokenizer, vocab_size=model.args.vocab_size
    )
    sources = [ForcedTextSource(constraint)] if forced else []
    return generate(
        model,
        tokenizer,
        prompt,
        constraint=constraint,
        draft_sources=sources,
        max_tokens=max_tokens,
        stats=DecodingStats(),
        **kwargs,
    )


@pytest.mark.parametrize("schema", TINY_SCHEMAS)
def test_tiny_model_outputs_validate_and_forced_drafts_are_lossless(schema):
    for prompt in ([1, 2, 3], [40, 41]):
        plain = run(schema, prompt, MODEL, TOKENIZER, False, 200)
        fast = run(schema, prompt, MODEL, TOKENIZER, True, 200)
        assert plain.finish_reason == "stop" and fast.tokens == plain.tokens
        validate(schema, plain.text)
        assert fast.stats.target_forward_passes < plain.stats.target_forward_passes


def test_tiny_model_sampled_outputs_validate():
    for seed in range(3):
        mx.random.seed(seed)
        result = run(TINY_SCHEMAS[0], [5, 6], MODEL, TOKENIZER, True, 200, sampling=Sampling(1.0))
        assert result.finish_reason == "stop"
        validate(TINY_SCHEMAS[0], result.text)


WEATHER_CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
}


def test_embedded_model_function_call_validates(embedded, chat_prompt):
    model, tokenizer, _ = embedded
    prompt = chat_prompt(
        "Call the weather tool for Paris in celsius for 3 days. Reply with JSON only."
    )
    plain = run(WEATHER_CALL, prompt, model, tokenizer, False, 80)
    fast = run(WEATHER_CALL, prompt, model, tokenizer, True, 80)
    assert plain.finish_reason == "stop" and fast.tokens == plain.tokens
    validate(WEATHER_CALL, plain.text)
    assert fast.stats.target_forward_passes < 0.8 * plain.stats.target_forward_passes


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--json-schema", "{not json"], "the schema is not valid JSON"),
        (["--json-schema", "{}", "--regex", "a"], "give --regex or --json-schema, not both"),
    ],
)
@pytest.mark.slow
def test_cli_bad_schemas_are_one_line(args, fragment):
    assert_one_line_error(cli(*args), fragment)


@pytest.mark.slow
def test_cli_json_schema_output_validates(embedded, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(WEATHER_CALL))
    result = cli(
        "--prompt",
        "Weather in Oslo, in fahrenheit? JSON only.",
        "--json-schema",
        str(path),
        "--json",
        "--max-tokens",
        "80",
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["finish_reason"] == "stop"
    validate(WEATHER_CALL, data["text"])
