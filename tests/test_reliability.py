"""Hostile schemas and regexes end in a compiled DFA or one refusal line, within the budget.

Each case below once hung, ran out of memory or printed a traceback (issue 19). The fuzz tests
generate random schemas and regexes of bounded size: each compiles or is refused with the
project's error type, and every compiled schema's DFA emits only instances `jsonschema` accepts.
"""

import json
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import jsonschema
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from benchmarks.hostile_inputs import DRIVER, nested, properties, ref_fanout
from constrained.json_schema import MAX_DEPTH, SchemaError, load_schema, schema_to_regex
from constrained.regex_dfa import RegexError, compile_regex
from tests.helpers import running

ROOT = Path(__file__).resolve().parent.parent


def refusal(schema) -> str:
    """The one-line message schema_to_regex refuses `schema` with (JSON text goes through
    load_schema)."""
    with pytest.raises(SchemaError) as caught:
        schema_to_regex(load_schema(schema) if isinstance(schema, str) else schema)
    message = str(caught.value)
    assert "\n" not in message
    return message


# --- size: optional members, $ref fan-out ------------------------------------------------------


def test_84000_optional_properties_are_refused_while_building():
    assert "too large: its regex passes" in refusal(properties(84_000))


def test_optional_members_are_written_once_and_keep_their_order():
    names = [f"k{index}" for index in range(300)]
    schema = {
        "type": "object",
        "properties": {name: {"type": "null"} for name in names},
        "required": ["k150"],
        "additionalProperties": False,
    }
    regex = schema_to_regex(schema)
    assert regex.count('"k7"') == 2  # linear: naming each possible first member wrote it 8 times
    dfa = compile_regex(regex)
    rng = random.Random(0)
    for _ in range(50):
        chosen = sorted(rng.sample(range(300), rng.randrange(300)) + [150])
        chosen = sorted(set(chosen))
        text = json.dumps({f"k{index}": None for index in chosen}, separators=(",", ":"))
        assert dfa.matches(text.encode())
        shuffled = chosen[::-1]
        if len(shuffled) > 1:  # another order is another regex's business: ours keeps schema order
            assert not dfa.matches(
                json.dumps({f"k{i}": None for i in shuffled}, separators=(",", ":")).encode()
            )
    assert not dfa.matches(b'{"k1":null}')  # k150 is required


def test_a_million_value_enum_is_refused_while_building():
    assert "too large: its regex passes" in refusal({"enum": list(range(1_000_000))})


def test_recursive_ref_fanout_is_refused_by_the_subschema_budget():
    assert "more than 20000 subschemas" in refusal(ref_fanout(40))


# --- numbers
# ---------------------------------------------------------------------------------------


def test_integer_bounds_of_24_digits_are_exact():
    lo, hi = 10**24, 2 * 10**24 + 7
    regex = schema_to_regex({"type": "integer", "minimum": lo, "maximum": hi})
    for value, inside in (
        (lo - 1, False),
        (lo, True),
        (lo + 12345, True),
        (hi, True),
        (hi + 1, False),
    ):
        assert (re.fullmatch(regex, str(value)) is not None) == inside, value


def test_a_bound_of_1e308_has_a_short_exact_form():
    lo = int(Fraction(1e308))  # the double nearest 1e308, exactly
    regex = schema_to_regex({"type": "integer", "minimum": 1e308})
    assert len(regex) < 20_000
    dfa = compile_regex(regex)
    for value, inside in (
        (lo - 1, False),
        (lo, True),
        (lo + 1, True),
        (10**309, True),
        (10**307, False),
    ):
        assert dfa.matches(str(value).encode()) == inside


@pytest.mark.parametrize(
    "text, pointer",
    [
        ('{"type": "number", "minimum": 1e400}', "#/minimum"),
        ('{"type": "number", "maximum": NaN}', "#/maximum"),
        ('{"properties": {"a/b": {"enum": [1, -Infinity]}}}', "#/properties/a~1b/enum/1"),
    ],
)
def test_non_finite_numbers_are_refused_with_their_pointer(text, pointer):
    assert refusal(text).endswith(f"not finite (NaN, Infinity or beyond ±1.8e308) at {pointer}")
    # Already when the schema is read, so the llguidance engine (main.py's default) refuses it the
    # same way.
    with pytest.raises(SchemaError, match=f"not finite .* at {pointer}"):
        load_schema(text)


def test_integer_bounds_beyond_float_range_are_refused():
    assert "minimum beyond ±1e308 is not supported at #/minimum" in refusal(
        {"type": "integer", "minimum": 10**400}
    )


def test_an_integer_python_cannot_read_is_one_line():
    assert "cannot read" in refusal('{"const": ' + "9" * 5000 + "}")


# --- depth
# -----------------------------------------------------------------------------------------


def test_a_schema_150_levels_deep_is_refused_past_the_documented_depth():
    assert f"nests more than {MAX_DEPTH} levels deep at #/properties/a/" in refusal(nested(150))
    assert compile_regex(schema_to_regex(nested(MAX_DEPTH - 1))).matches(
        ('{"a":' * (MAX_DEPTH - 1) + '"x"' + "}" * (MAX_DEPTH - 1)).encode()
    )


def test_json_nested_100000_levels_is_one_line():
    assert refusal("[" * 100_000 + "]" * 100_000) == "the schema nests too deeply to read"


@pytest.mark.parametrize("depth", [250, 1000])
def test_deeply_nested_regex_groups_compile_without_recursion(depth):
    assert compile_regex("(" * (5 * depth) + "a" + ")" * (5 * depth)).matches(b"a")
    # A Concat/Repeat tree `depth` levels deep (each closure spans the open levels: depth^2 work).
    dfa = compile_regex("(?:a" * depth + ")?" * depth)
    assert dfa.matches(b"a" * depth) and dfa.matches(b"") and not dfa.matches(b"a" * (depth + 1))


def test_a_deep_pattern_keyword_is_refused_in_one_line():
    assert "nested more than 100 deep" in refusal(
        {"type": "string", "pattern": "(" * 150 + "a" + ")" * 150}
    )


# --- patterns that make Python's re backtrack --------------------------------------------------


def test_enum_filtered_by_a_backtracking_pattern_is_quick():
    schema = {"type": "string", "pattern": "^(a*)*b$", "enum": ["a" * 40, "a" * 10 + "b"]}
    assert schema_to_regex(schema) == '(?:"aaaaaaaaaab")'


def test_pattern_properties_checked_against_names_without_backtracking():
    schema = {"properties": {"a" * 40: {"type": "null"}}, "patternProperties": {"^(a*)*b$": {}}}
    assert compile_regex(schema_to_regex(schema)).matches(b'{"' + b"a" * 40 + b'":null}')


# --- the whole path: main.py, one line, exit 1, within the budget --------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, value, message",
    [
        ("schema", properties(84_000), "too large"),
        ("schema", {"type": "integer", "minimum": 1e308}, None),
        ("schema", nested(150), "nests more than"),
        ("regex", "(" * 250 + "a" + ")" * 250, None),
    ],
)
def test_hostile_inputs_finish_within_the_budget(kind, value, message, tmp_path):
    # A guard against hangs, not a speed test: the budget is ~2 s on a quiet machine, the limit 30
    # s.
    argument = tmp_path / "schema.json" if kind == "schema" else value
    if kind == "schema":
        argument.write_text(json.dumps(value))
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, kind, str(argument)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["added_mb"] < 1024
    if message is None:
        assert report["outcome"].startswith("compiled") and result.stderr == ""
    else:
        assert result.stderr.count("\n") == 1 and message in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine, start",
    [
        ("regex", "error: the schema is too large"),
        ("llguidance", "error: llguidance refused the schema"),
    ],
)
def test_main_refuses_a_hostile_schema_in_one_line(engine, start, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(properties(84_000)))
    result = subprocess.run(
        [sys.executable, "main.py", "--json-schema", str(schema), "--json-schema-engine", engine],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and result.stderr.startswith(start)
    assert result.stderr.count("\n") == 1


@pytest.mark.slow
@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_generation_is_one_line(sig, status):
    command = [sys.executable, "main.py", "--max-tokens", "400", "--prompt", "Count to 500."]
    with running(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        process.stdout.read(20)  # generation has started
        process.send_signal(sig)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == status and stderr == b"interrupted\n"


# --- fuzz: random schemas and regexes of bounded size ----------------------------------------

leaf_schemas = st.one_of(
    st.fixed_dictionaries(
        {"type": st.just("string")},
        optional={
            "minLength": st.integers(0, 4),
            "maxLength": st.integers(0, 6),
            "pattern": st.sampled_from(["^a+$", "b", "^(x|yz)*$", "(a*)*b", "^[0-9]{2}$"]),
            "format": st.sampled_from(["date", "email", "uuid", "not-a-format"]),
        },
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["integer", "number"])},
        optional={
            "minimum": st.one_of(
                st.integers(-(10**30), 10**30), st.floats(-1e308, 1e308), st.just(float("nan"))
            ),
            "maximum": st.one_of(
                st.integers(-(10**30), 10**30), st.floats(allow_nan=True, allow_infinity=True)
            ),
            "exclusiveMinimum": st.integers(-100, 100),
            "multipleOf": st.sampled_from([1, 0.5, 3]),
        },
    ),
    st.fixed_dictionaries(
        {
            "enum": st.lists(
                st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text("ab", max_size=3)),
                min_size=1,
                max_size=4,
            )
        }
    ),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, {}, True, False, {"not": {}}]),
)


def composite_schemas(children):
    names = st.text("abc/~", min_size=1, max_size=3)
    return st.one_of(
        st.dictionaries(names, children, max_size=4).flatmap(
            lambda props: st.fixed_dictionaries(
                {"type": st.just("object"), "properties": st.just(props)},
                optional={
                    "required": st.lists(st.sampled_from(sorted(props) or ["a"]), unique=True),
                    "additionalProperties": st.just(False),
                },
            )
        ),
        st.fixed_dictionaries(
            {"type": st.just("array"), "items": children},
            optional={"minItems": st.integers(0, 3), "maxItems": st.integers(0, 4)},
        ),
        st.lists(children, min_size=1, max_size=3).map(lambda options: {"anyOf": options}),
        st.lists(children, min_size=1, max_size=2).map(lambda parts: {"allOf": parts}),
    )


SCHEMAS = st.recursive(leaf_schemas, composite_schemas, max_leaves=10)


def validates(schema, text: bytes):
    """True or False; None where jsonschema cannot judge: a number past a double's range (``7e2534``
    parses to inf, and ``multipleOf`` then overflows inside jsonschema)."""
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    try:
        return not list(validator.iter_errors(json.loads(text)))
    except OverflowError:
        return None


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(schema=SCHEMAS, seed=st.integers(0, 2**32 - 1))
# 7e2534
@example(
    schema={"anyOf": [{"type": "integer", "minimum": 0, "multipleOf": 0.5}, {"type": "number"}]},
    seed=0,
)
def test_random_schemas_compile_or_are_refused_and_emit_only_valid_json(schema, seed):
    start = time.perf_counter()
    try:
        dfa = compile_regex(schema_to_regex(schema))
    except RegexError as error:  # SchemaError is one
        assert "\n" not in str(error)
        return
    assert time.perf_counter() - start < 30  # a hang guard; the budget is about 2 s
    rng = random.Random(seed)
    for _ in range(5):
        text = dfa.sample(rng, max_bytes=400)
        if text is not None:
            assert validates(schema, text) is not False, (schema, text)


REGEX_PIECES = [
    "a",
    "b",
    ".",
    r"\d",
    "[a-c]",
    "[^x]",
    "(",
    ")",
    "(?:",
    "|",
    "*",
    "+",
    "?",
    "{2}",
    "{1,3}",
    "{300}",
    "\\",
    "$",
    "^",
    "[",
    "(?=a)",
    "é",
]


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(REGEX_PIECES), max_size=40), depth=st.integers(0, 2000))
def test_random_regexes_compile_or_are_refused_in_one_line(pieces, depth):
    pattern = "(?:" * depth + "".join(pieces) + ")" * depth
    try:
        dfa = compile_regex(pattern)
    except RegexError as error:
        assert "\n" not in str(error)
        return
    try:
        oracle = re.compile(pattern, re.ASCII) if depth < 100 else None  # re's parser recurses
    except re.error:
        # re refuses some patterns we accept (e.g. a{,2} differences); test_regex_dfa covers
        # agreement
        return
    for length in range(4):
        for text in ("a" * length, "ab" * length, "1" * length):
            if oracle is not None:
                assert dfa.matches(text.encode()) == (oracle.fullmatch(text) is not None), (
                    pattern,
                    text,
                )


# --- distributed: a failed rank fails the run ------------------------------------------------

RANK = """
import os, signal, sys, time
if os.environ.get("MLX_RANK") == "1":
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # killed early, before any line
    sys.exit(int(sys.argv[1]))
time.sleep(20)  # rank 0 would wait on its peer; mlx.launch stops it
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "rank1, status, line",
    [
        ("0", 0, None),
        ("3", 1, "error: rank 1 exited with status 3; mlx.launch then stopped 1 other rank(s)\n"),
        (
            "kill",
            1,
            "error: rank 1 exited with status -9; mlx.launch then stopped 1 other rank(s)\n",
        ),
    ],
)
def test_distributed_launch_exits_non_zero_when_a_rank_fails(rank1, status, line):
    if shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("mlx.launch is not installed")
    code = RANK if rank1 != "0" else "import sys"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "distributed.launch",
            "-n",
            "2",
            "--backend",
            "ring",
            "--",
            sys.executable,
            "-c",
            code,
            rank1,
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == status
    # mlx.launch may find the other rank already ended when it stops it (a race), and not count it
    stopped = "; mlx.launch then stopped 1 other rank(s)"
    assert result.stderr in ((line or ""), (line or "").replace(stopped, ""))
