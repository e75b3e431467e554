"""Grammar-constrained decoding (llguidance) in the loop: lossless drafts, exact masks, outputs an
independent parser accepts (the `lark` package, jsonschema), the GBNF corpus, the CLI."""

import json
import random
import subprocess
import sys
from pathlib import Path

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("llguidance")
pytest.importorskip("lark")

from constrained import RegexConstraint  # noqa: E402
from constrained.grammar import (
    GrammarConstraint,
    GrammarError,
    GrammarForcedSource,  # noqa: E402
    compile_grammar,
)
from decoder import DecodingStats, Sampling, generate  # noqa: E402
from draft_model import DraftModel  # noqa: E402
from prompt_lookup import PromptLookupSource  # noqa: E402
from tests.helpers import (
    ScriptedSource,
    assert_constrained_sampling_is_exact,
    tiny_byte_tokenizer,
    tiny_llama,
)  # noqa: E402
from tests.lark_oracle import lark_parser, parses  # noqa: E402
from tests.test_cli import ROOT, assert_one_line_error, cli  # noqa: E402

GBNF_DIR = Path(__file__).parent / "data" / "gbnf"
TOKENIZER = tiny_byte_tokenizer()
EOS = TOKENIZER.eos_token_id
# logits wider than the tokenizer, as SmolLM2's may be: masks pad with False
VOCAB = len(TOKENIZER) + 5
MODEL = tiny_llama(vocab_size=VOCAB, num_layers=2, hidden_size=32, seed=7, sharp=3.0)
DRAFT_MODEL = tiny_llama(vocab_size=VOCAB, num_layers=1, hidden_size=32, seed=8, sharp=3.0)

EXPRESSION = """start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""
LARK_GRAMMARS = [
    'start: "yes" | "no" | "maybe"',
    "start: /[0-9]{4}-[0-9]{2}-[0-9]{2}/",
    EXPRESSION,
    'start: "{\\"name\\": \\"" /[a-z]{1,8}/ "\\", \\"tags\\": [" (TAG ("," TAG)*)? "]}"\n'
    'TAG: /"[a-c]{1,3}"/',
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def grammar_constraint(grammar, tokenizer=TOKENIZER, vocab_size=VOCAB):
    if isinstance(grammar, dict):
        return GrammarConstraint.from_json_schema(grammar, tokenizer, vocab_size)
    return GrammarConstraint.from_grammar(grammar, tokenizer, vocab_size)


def run(grammar, prompt, sources=(), model=MODEL, max_tokens=40, **kwargs):
    constraint = grammar_constraint(grammar)
    sources = [source(constraint) if callable(source) else source for source in sources]
    return generate(
        model,
        TOKENIZER,
        prompt,
        constraint=constraint,
        draft_sources=sources,
        max_tokens=max_tokens,
        stats=DecodingStats(),
        **kwargs,
    )


def forced(constraint):
    return GrammarForcedSource(constraint)


# --- losslessness --------------------------------------------------------------------------------


def noise_source(seed):
    rng = random.Random(seed)
    # Ids past the tokenizer's vocabulary too: the walk must cut them, not break the matcher.
    return ScriptedSource(lambda tokens, k: [rng.randrange(VOCAB) for _ in range(k)], name="noise")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    grammar=st.sampled_from(LARK_GRAMMARS + [SCHEMA]),
    prompt=st.lists(st.integers(0, 255), min_size=1, max_size=6),
    seed=st.integers(0, 1000),
)
def test_greedy_output_is_the_same_with_every_draft_source(grammar, prompt, seed):
    reference = run(grammar, prompt)
    assert reference.stats.target_forward_passes == reference.generation_tokens

    def lookup():
        return PromptLookupSource(ngram_max=2, num_draft=4, adaptive=False)

    draft_model = DraftModel(DRAFT_MODEL, VOCAB, num_draft=3, adaptive=False).source()
    for sources in (
        [forced],
        [noise_source(seed)],
        [lookup()],
        [draft_model],
        [forced, lookup(), noise_source(seed)],
    ):
        result = run(grammar, prompt, sources)
        assert result.tokens == reference.tokens, list(result.stats.sources)


def test_forced_text_saves_target_steps_and_names_its_source():
    plain = run(SCHEMA, [5, 6, 7], max_tokens=60)
    fast = run(SCHEMA, [5, 6, 7], [forced], max_tokens=60)
    assert fast.tokens == plain.tokens and plain.finish_reason == "stop"
    assert fast.stats.target_forward_passes < plain.stats.target_forward_passes
    assert "grammar" in fast.sources


def test_the_same_constraint_is_reusable_after_reset():
    constraint = grammar_constraint(EXPRESSION)
    first = generate(
        MODEL,
        TOKENIZER,
        [3, 4],
        constraint=constraint,
        draft_sources=[forced(constraint)],
        max_tokens=30,
    )
    constraint.reset()
    again = generate(MODEL, TOKENIZER, [3, 4], constraint=constraint, max_tokens=30)
    assert again.tokens == first.tokens


# --- masks ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lark_grammar, regex",
    [
        ("start: /[0-9]{4}-[0-9]{2}-[0-9]{2}/", r"\d{4}-\d{2}-\d{2}"),
        ("start: /(ab)+/", r"(ab)+"),
        ('start: /[a-c]+/ "@example.com"', r"[a-c]+@example\.com"),
        ('start: "name" | "names: " /[a-z]{0,3}/', r"name|names: [a-z]{0,3}"),
    ],
)
def test_masks_equal_the_regex_engines_masks(lark_grammar, regex, tmp_path):
    """Two engines, one language: llguidance's masks equal the hand-written DFA's token index at
    every position of random walks, EOS and padding included, except one documented difference:
    inside text the grammar forces, llguidance also drops tokens that split it non-canonically (only
    "ab", not "a", when "ab" is forced and is a token)."""
    grammar = grammar_constraint(lark_grammar)
    dfa = RegexConstraint.from_regex(regex, TOKENIZER, VOCAB, cache_dir=tmp_path)
    rng = random.Random(0)
    for _ in range(5):
        grammar.reset()
        dfa.state = dfa.index.start
        for _ in range(20):
            expected = np.array(dfa.masks(dfa.walk([])))[0]
            allowed = np.array(grammar.masks(grammar.walk([])))[0]
            forced_text = grammar.matcher.compute_ff_bytes()
            assert (allowed <= expected).all()
            for token in np.flatnonzero(expected & ~allowed):
                token_text = TOKENIZER.decode([int(token)]).encode()
                assert forced_text.startswith(token_text) and token_text != forced_text, (
                    token_text,
                    forced_text,
                )
            token = rng.choice(np.flatnonzero(allowed).tolist())
            if token == EOS:
                break
            grammar.advance([token])
            dfa.advance([token])


def test_draft_masks_equal_step_by_step_masks_and_rollback_is_exact():
    constraint, stepper = grammar_constraint(SCHEMA), grammar_constraint(SCHEMA)
    draft = TOKENIZER.encode('{"name":"bo","age":7}', add_special_tokens=False) + [EOS]
    states = constraint.walk(draft + [5])  # 5 after EOS is forbidden: the walk stops before it
    assert len(states) == len(draft) + 1
    masks = np.array(constraint.masks(states))
    for position, token in enumerate(draft):
        assert np.array_equal(masks[position], np.array(stepper.masks(stepper.walk([])))[0]), (
            position
        )
        if token != EOS:
            stepper.advance([token])
    assert masks[-1].tolist() == [token == EOS for token in range(VOCAB)]  # after EOS, only EOS
    assert not masks[:, len(TOKENIZER) :].any()  # padding past the tokenizer
    # The matcher is back where it started: the same walk gives the same masks.
    assert np.array_equal(np.array(constraint.masks(constraint.walk(draft))), masks)


def test_walk_keeps_the_first_forbidden_or_out_of_vocabulary_token_to_be_rejected():
    constraint = grammar_constraint('start: "yes" | "no"')
    yes = TOKENIZER.encode("yes", add_special_tokens=False)
    assert len(constraint.walk(yes + [EOS])) == len(yes) + 2
    for bad in (TOKENIZER.encode("x", add_special_tokens=False)[0], VOCAB - 1):
        states = constraint.walk(yes[:1] + [bad] + yes[1:])
        assert len(states) == 2  # before the first token and after it; the walk stops at `bad`
        masks = np.array(constraint.masks(states))
        assert masks.shape[0] == 2 and not masks[1, bad]
    assert not constraint.matcher.is_error()


# --- sampling ------------------------------------------------------------------------------------


def test_sampling_keeps_the_masked_target_distribution():
    """Two sampled tokens under a grammar, with a random source that has its own distribution,
    against the target's masked joint distribution computed by brute force."""
    assert_constrained_sampling_is_exact(MODEL, grammar_constraint("start: /[a-e]{2}/"))


# --- outputs an independent parser accepts
# ----------------------------------------------------------


class EndsSoon:
    """The tiny model with bonuses, after `min_tokens` generated tokens, on EOS and on characters
    that close things (quotes, brackets, newlines, "="), so sampled outputs end soon after a grammar
    allows it: a random model rarely closes a JSON string or picks EOS by itself."""

    CLOSERS = {'"': 5.0, "}": 3.0, "]": 3.0, "\n": 3.0, "=": 2.0}

    def __init__(self, model, prompt_length, min_tokens=6):
        self.model, self.layers, self.args = model, model.layers, model.args
        # cache position of the first token given the bonus
        self.start = prompt_length - 1 + min_tokens
        bonus = np.zeros(model.args.vocab_size, dtype=np.float32)
        bonus[EOS] = 6.0
        for char, value in self.CLOSERS.items():
            bonus[TOKENIZER.encode(char, add_special_tokens=False)[0]] = value
        self.bonus = mx.array(bonus)

    def __call__(self, inputs, cache=None):
        logits = self.model(inputs, cache=cache)
        positions = cache[0].offset - inputs.shape[1] + mx.arange(inputs.shape[1])
        return logits + mx.where(positions[:, None] >= self.start, self.bonus, 0)[None]


def finished_samples(grammar, wanted=2, max_seeds=8, max_tokens=60):
    """Texts of up to `wanted` sampled outputs that ended with EOS (a random model may not end
    one)."""
    prompt, texts = [7, 8, 9], []
    for seed in range(max_seeds):
        mx.random.seed(seed)
        result = run(
            grammar,
            prompt,
            [forced],
            model=EndsSoon(MODEL, len(prompt)),
            max_tokens=max_tokens,
            sampling=Sampling(1.0),
        )
        if result.finish_reason == "stop":
            texts.append(result.text)
            if len(texts) == wanted:
                break
    return texts


@pytest.mark.parametrize("grammar", LARK_GRAMMARS)
def test_lark_outputs_parse_with_the_lark_package(grammar):
    parser = lark_parser(grammar)
    finished = finished_samples(grammar)
    assert finished and all(parses(parser, text) for text in finished), finished


def test_json_schema_outputs_validate_where_the_regex_engine_refuses():
    """Recursion and patternProperties: the regex compiler cuts or refuses these, llguidance does
    not."""
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer", "minimum": 0, "maximum": 9},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["v"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    }
    pattern_keys = {
        "type": "object",
        "patternProperties": {"^x_[a-c]{1,2}$": {"type": "boolean"}},
        "additionalProperties": False,
        "minProperties": 1,
        "maxProperties": 2,
    }
    for schema in (tree, pattern_keys, SCHEMA):
        finished = finished_samples(schema, max_tokens=80)
        assert finished, schema
        for text in finished:
            jsonschema.Draft202012Validator(schema).validate(json.loads(text))


GBNF_FILES = sorted(GBNF_DIR.glob("*.gbnf"))
# Grammars that load but cannot generate a finished output, with the reason
# (tests/data/gbnf/README.md).
UNFINISHABLE = {
    # NUM and IDENT become lexemes ending in WS ([ \t\n]*), and llguidance lexes greedily: the
    # root's final "\n" is always taken as more whitespace, so EOS is never allowed. A CFG parser
    # accepts "1=2\n".
    "arithmetic": "1=2\n"
}


@pytest.mark.parametrize("path", GBNF_FILES, ids=lambda path: path.stem)
def test_llama_cpp_grammars_load_and_generate_output_lark_accepts(path):
    """llama.cpp's grammars/*.gbnf: every one loads in llguidance, and every finished sample parses
    with the `lark` package on the converted grammar; the unfinishable ones are checked to be so."""
    from llguidance.gbnf_to_lark import gbnf_to_lark

    text = path.read_text()
    parser = lark_parser(gbnf_to_lark(text))
    if path.stem in UNFINISHABLE:
        example = UNFINISHABLE[path.stem]
        constraint = grammar_constraint(text)
        tokens = TOKENIZER.encode(example, add_special_tokens=False)
        assert parses(parser, example) and constraint.matcher.validate_tokens(
            tokens + [EOS]
        ) == len(tokens)
        return
    finished = finished_samples(text)
    assert finished, f"no sample of {path.name} finished"
    for output in finished:
        assert parses(parser, output), (path.name, output)
    assert not parses(parser, finished[0] + "\x01")  # the oracle can refuse


def test_gbnf_is_detected_and_bad_grammars_raise_one_clear_error():
    assert compile_grammar('root ::= "a"') and compile_grammar('start: "a"')
    with pytest.raises(GrammarError, match="unknown name"):
        compile_grammar("start: missing")
    with pytest.raises(GrammarError, match="GBNF"):
        compile_grammar('root ::= ( "a"')
    with pytest.raises(GrammarError, match="Unimplemented keys"):
        GrammarConstraint.from_json_schema(
            {"if": {"type": "integer"}, "then": {"minimum": 1}}, TOKENIZER, VOCAB
        )


# --- the command line ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--grammar", "start: missing"], "llguidance refused the grammar: "),
        (["--grammar", 'root ::= "a"', "--regex", "a"], "give --grammar alone"),
        (["--grammar", "missing.gbnf"], "grammar file not found: missing.gbnf"),
        (
            ["--json-schema", '{"type": "object", "propertyNames": {"maxLength": 3}}'],
            "Unimplemented keys",
        ),
    ],
)
def test_cli_refusals_are_one_line(args, fragment):
    assert_one_line_error(cli(*args), fragment)


def test_cli_without_llguidance_says_what_to_install():
    block = (
        "import runpy, sys; sys.modules['llguidance'] = None; "
        "sys.argv = ['main.py'] + sys.argv[1:]; "
        "runpy.run_path('main.py', run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", block, "--grammar", 'root ::= "a"'],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert_one_line_error(result, "pip install llguidance")


def test_the_library_without_llguidance_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(GrammarError, match="pip install llguidance"):
        GrammarConstraint.from_grammar('start: "a"', TOKENIZER, VOCAB)


# regex: "multipleOf 7"
ONLY_LLGUIDANCE = {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 99}
# llguidance: "Unimplemented keys"; regex: "not"
NEITHER = {"type": "string", "not": {"const": "a"}}


def test_compile_schema_prefers_llguidance_and_falls_back_in_one_line(monkeypatch, capsys):
    from constrained import SchemaError, schema_to_regex
    from constrained.build import compile_schema

    assert compile_schema(ONLY_LLGUIDANCE)[0] == "grammar" and capsys.readouterr().err == ""
    assert compile_schema(True) == ("regex", schema_to_regex(True))  # any JSON value
    assert capsys.readouterr().err == (
        "note: llguidance refused the schema (Expecting object schema to apply "
        "options); using the built-in compiler\n"
    )
    # asked for by name: no fallback
    with pytest.raises(GrammarError, match="Expecting object schema"):
        compile_schema(True, "llguidance")
    with pytest.raises(SchemaError) as caught:
        compile_schema(NEITHER)
    message = str(caught.value)
    assert (
        "Unimplemented keys" in message
        and "the built-in compiler refused it too: not is not supported" in message
    )
    assert "\n" not in message and capsys.readouterr().err == ""
    monkeypatch.setitem(sys.modules, "llguidance", None)
    assert compile_schema({"type": "boolean"}) == ("regex", schema_to_regex({"type": "boolean"}))
    assert "llguidance is not installed" in capsys.readouterr().err
    with pytest.raises(GrammarError, match="pip install llguidance"):
        compile_schema({"type": "boolean"}, "llguidance")


def test_main_py_compiles_the_schema_with_compile_schema(capsys):
    import main
    from constrained import schema_to_regex

    def validated(*flags):
        args = main.build_parser().parse_args(list(flags))
        main.validate(args)
        return args

    form, grammar = validated("--json-schema", json.dumps(ONLY_LLGUIDANCE)).compiled_pattern
    assert form == "grammar" and grammar
    compiled = validated("--json-schema", "true").compiled_pattern
    assert compiled == ("regex", schema_to_regex(True))
    assert capsys.readouterr().err.startswith("note: llguidance refused the schema (")
    assert validated("--json-schema", "true", "--json-schema-engine", "regex").compiled_pattern == (
        compiled
    )
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_cli_gbnf_and_lark_grammars_with_the_embedded_model(embedded):
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    lark_grammar = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    for grammar in (gbnf, lark_grammar):
        result = cli(
            "--prompt", "Is Paris in France?", "--grammar", grammar, "--json", "--prompt-lookup"
        )
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        assert data["finish_reason"] == "stop" and data["text"] in (
            "The answer is yes.",
            "The answer is no.",
        )
        assert data["draft_sources"]["grammar"]["accepted"] > 0
