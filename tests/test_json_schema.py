"""JSON Schema -> regex: each feature, refusals, and `jsonschema` (format checks on) as the
oracle."""

import json
import random
import re
from fractions import Fraction

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from constrained.json_regex import integer_range, number_range, pattern_string
from constrained.json_schema import SchemaError, load_schema, schema_to_regex
from constrained.regex_dfa import compile_regex

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 3, None]}, "maxItems": 3},
        "height": {"type": "number", "exclusiveMinimum": 0, "maximum": 2.5},
    },
    "required": ["name", "age"],
}
TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "value": {"type": "integer"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            },
            "required": ["value"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}
CALL = {
    "oneOf": [
        {
            "type": "object",
            "properties": {
                "tool": {"const": "search"},
                "query": {"type": "string", "maxLength": 20},
            },
            "required": ["tool", "query"],
        },
        {
            "type": "object",
            "properties": {
                "tool": {"const": "weather"},
                "city": {"type": "string"},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["tool", "city"],
        },
    ]
}
SCHEMAS = {
    "person": PERSON,
    "tree": TREE,
    "call": CALL,
    "all_optional": {"type": "object", "properties": {k: {"type": "boolean"} for k in "abcd"}},
    "middle_required": {
        "properties": {"a": {"type": "null"}, "b": {"type": "integer"}, "c": {"type": "null"}},
        "required": ["b"],
    },
    "tuple": {
        "type": "array",
        "prefixItems": [{"type": "string", "format": "date"}, {"type": "integer"}],
        "items": {"type": "boolean"},
        "minItems": 1,
        "maxItems": 4,
    },
    "formats": {
        "type": "array",
        "prefixItems": [
            {"type": "string", "format": name}
            for name in ["date", "time", "date-time", "uuid", "email", "uri", "ipv4", "hostname"]
        ],
        "minItems": 8,
    },
    "map": {
        "type": "object",
        "additionalProperties": {"type": "integer", "minimum": -5, "maximum": 5},
    },
    "any": {},
    # any JSON value, as {} (llguidance refuses it: the server and main.py fall back to this
    # compiler)
    "true": True,
    "types": {"type": ["string", "integer", "null"], "maxLength": 3, "minimum": 10},
    "all_of": {
        "allOf": [
            {"properties": {"a": {"type": "integer", "minimum": 0}}},
            {"properties": {"a": {"maximum": 9}}, "required": ["a"]},
        ]
    },
    "any_of": {
        "anyOf": [
            {"type": "string", "pattern": "^[a-z]+-\\d$"},
            {"type": "number", "minimum": -1.5, "exclusiveMaximum": 2},
        ]
    },
    "const": {"const": {"k": [1, "two", None]}},
    "pattern_search": {"type": "string", "pattern": "a.c"},
    "unique": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "half_steps": {"type": "number", "multipleOf": 0.5, "minimum": -3, "maximum": 3},
    "dependencies": {
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "integer"},
            "c": {"type": "null"},
            "d": {"type": "boolean"},
        },
        "required": ["c"],
        "dependencies": {"a": ["b"]},
        "dependentRequired": {"c": ["b"], "d": ["x"]},
    },
    "pattern_map": {
        "type": "object",
        "patternProperties": {"^x-[a-z]+$": {"type": "integer"}},
        "additionalProperties": False,
        "minProperties": 1,
    },
    "pattern_length": {
        "type": "string",
        "pattern": "^[a-z]+(-[a-z]+)*$",
        "minLength": 1,
        "maxLength": 12,
    },
}


def validator(schema):
    return jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )


DFAS = {name: compile_regex(schema_to_regex(schema)) for name, schema in SCHEMAS.items()}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(SCHEMAS)), seed=st.integers(0, 2**32 - 1))
def test_random_walks_of_the_dfa_validate(name, seed):
    text = DFAS[name].sample(random.Random(seed), max_bytes=300)
    if text is not None:
        errors = [error.message for error in validator(SCHEMAS[name]).iter_errors(json.loads(text))]
        assert not errors, (text, errors)


# --- valid instances (in schema order) match --------------------------------------------------

# Bounded strings leave out \u escapes (a documented subset), so names hold no control characters.
names = st.text(st.characters(exclude_categories=["Cs", "Cc"]), min_size=1, max_size=12)
person = st.fixed_dictionaries(
    {"name": names, "age": st.integers(0, 130)},
    optional={
        "email": st.from_regex(r"[a-z0-9._]{1,8}@[a-z]{1,8}\.[a-z]{2,3}", fullmatch=True),
        "tags": st.lists(st.sampled_from(["a", "b", 3, None]), max_size=3),
        "height": st.decimals(min_value=Fraction(1, 1000), max_value=Fraction(5, 2), places=3).map(
            float
        ),
    },
)


def in_order(value, order):
    return {key: value[key] for key in order if key in value}


@settings(max_examples=100, deadline=None)
@given(value=person)
def test_valid_people_match(value):
    value = in_order(value, PERSON["properties"])
    assert not list(validator(PERSON).iter_errors(value))
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    # A fraction is allowed where its whole integer part is in range (0 < I and I + 1 <= 2.5; see
    # number_range).
    if 1 <= value.get("height", 1) < 2:
        assert DFAS["person"].matches(text.encode()), text


tree = st.recursive(
    st.fixed_dictionaries({"value": st.integers(-(10**6), 10**6)}),
    lambda children: st.fixed_dictionaries(
        {"value": st.integers(), "children": st.lists(children, max_size=3)}
    ),
    max_leaves=6,
)


@settings(max_examples=60, deadline=None)
@given(value=tree)
def test_trees_within_the_recursion_depth_match(value):
    def depth(node):
        return 1 + max((depth(child) for child in node.get("children", [])), default=0)

    def ordered(node):
        node = in_order(node, ["value", "children"])
        return (
            {**node, "children": [ordered(child) for child in node["children"]]}
            if "children" in node
            else node
        )

    text = json.dumps(ordered(value), separators=(",", ":"))
    assert DFAS["tree"].matches(text.encode()) == (depth(value) <= 3), text


@pytest.mark.parametrize(
    "value",
    [
        {"tool": "search", "query": "mlx"},
        {"tool": "weather", "city": "Paris", "unit": "C"},
        {"tool": "weather", "city": "Oslo"},
    ],
)
def test_discriminated_one_of_matches(value):
    assert DFAS["call"].matches(json.dumps(value, separators=(",", ":")).encode())


@pytest.mark.parametrize(
    "name, texts",
    [
        (
            "all_optional",
            ["{}", '{"a":true}', '{"b":false,"d":true}', '{"a":true,"b":true,"c":false,"d":true}'],
        ),
        (
            "middle_required",
            ['{"b":1}', '{"a":null,"b":-2}', '{"b":0,"c":null}', '{"a":null,"b":3,"c":null}'],
        ),
        ("tuple", ['["2024-02-28"]', '["2024-12-31",7,true,false]']),
        ("map", ["{}", '{"x":5}', '{"x":-5,"y":0}']),
        ("types", ['"abc"', "10", "999", "null"]),
        ("true", ["null", "false", "-1.5e3", '"x"', "[]", "{}", '[1,"a",null]', '{"k":1}']),
        ("const", ['{"k":[1,"two",null]}']),
        ("unique", ["[]", "[7]"]),
        ("half_steps", ["-3", "0", "3"]),
        ("dependencies", ['{"b":1,"c":null}', '{"a":1,"b":2,"c":null}']),
        ("pattern_map", ['{"x-a":1}', '{"x-a":1,"x-bc":-2}']),
        ("pattern_length", ['"abc"', '"a-b-c"', '"abc-def"']),
    ],
)
def test_examples_match(name, texts):
    for text in texts:
        assert DFAS[name].matches(text.encode()), text


@pytest.mark.parametrize(
    "name, texts",
    [
        (
            "all_optional",
            ['{,"a":true}', '{"a":true,}', '{"b":true,"a":true}', '{"a":true"b":true}'],
        ),
        ("middle_required", ["{}", '{"a":null}', '{"a":null,"c":null}']),
        ("tuple", ["[]", '["2023-02-29"]', '["2024-13-01"]', '["2024-01-01",1,true,true,true]']),
        ("map", ['{"x":6}', '{"x":1,}']),
        ("types", ['"abcd"', "9", "-10", "true"]),
        ("true", ["", "nul", "[1,]", "01", '"a', " 1", '{"k":1,}']),
        ("unique", ["[1,2]"]),
        ("half_steps", ["3.5", "4"]),
        ("dependencies", ['{"c":null}', '{"b":1,"c":null,"d":true}']),
        ("pattern_map", ["{}", '{"y":1}', '{"x-A":1}']),
        ("pattern_length", ['"abcdefghijklm"', '""', '"a--b"']),
    ],
)
def test_counter_examples_do_not_match(name, texts):
    for text in texts:
        assert not DFAS[name].matches(text.encode()), text


def test_whitespace_policy():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"type": "integer"}}},
    }
    pretty = compile_regex(schema_to_regex(schema, whitespace=r"[ \n]{0,2}"))
    compact = DFAS["all_optional"]
    assert pretty.matches(b'{ "a" : [ 1 , 2 ] }') and pretty.matches(b'{"a":[1,2]}')
    assert not compile_regex(schema_to_regex(schema)).matches(b'{ "a": [1] }')
    assert not compact.matches(b"{ }")


def test_annotations_are_ignored():
    annotated = {
        "title": "T",
        "description": "d",
        "examples": [1],
        "default": 2,
        "$schema": "x",
        "$id": "y",
        "$comment": "c",
        "type": "integer",
    }
    assert schema_to_regex(annotated) == schema_to_regex({"type": "integer"})


# --- leaves ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lo, hi",
    [
        (0, 255),
        (-5, 17),
        (None, -3),
        (10, None),
        (-100, None),
        (7, 7),
        (1, 10**6),
        (None, None),
        (-999, -10),
        (-1, 0),
        (5, 4),
    ],
)
def test_integer_ranges_are_exact(lo, hi):
    regex = integer_range(lo, hi)
    for value in range(-1200, 1200):
        expected = (lo is None or value >= lo) and (hi is None or value <= hi)
        assert (regex is not None and re.fullmatch(regex, str(value)) is not None) == expected, (
            lo,
            hi,
            value,
        )


@settings(max_examples=200, deadline=None)
@given(
    lo=st.none() | st.fractions(-50, 50, max_denominator=4),
    hi=st.none() | st.fractions(-50, 50, max_denominator=4),
    lo_exclusive=st.booleans(),
    hi_exclusive=st.booleans(),
    value=st.decimals(-60, 60, places=2),
)
def test_number_ranges_are_sound(lo, hi, lo_exclusive, hi_exclusive, value):
    regex = number_range(lo, lo_exclusive, hi, hi_exclusive)
    for text in (str(value), str(int(value))):
        if regex is not None and re.fullmatch(regex, text):
            number = Fraction(text)
            assert lo is None or (number > lo if lo_exclusive else number >= lo)
            assert hi is None or (number < hi if hi_exclusive else number <= hi)


@pytest.mark.parametrize(
    "pattern, texts",
    [
        ("ab", ["ab", "xaby", "ba", ""]),
        ("^ab", ["ab", "abx", "xab"]),
        ("b$", ["ab", "ba"]),
        ("^[a-z]+\\d{2}$", ["abc12", "abc1", "ABC12"]),
        ("^\\D+$", ["abc", "a1", "é"]),
        ("^.$", ["x", "é", '"']),
    ],
)
def test_patterns_search_the_decoded_string(pattern, texts):
    regex = pattern_string(pattern)
    for text in texts:
        expected = (
            re.search(pattern, text) is not None
            and re.fullmatch(r'[^"\\\x00-\x1f]*', text) is not None
        )
        expected = expected and (not re.search(r"\\[DWS]", pattern) or text.isascii())
        assert (
            re.fullmatch(regex, json.dumps(text, ensure_ascii=False)) is not None
        ) == expected, (pattern, text)


# --- refusals and bad schemas ---------------------------------------------------------------


@pytest.mark.parametrize(
    "schema, message",
    [
        ({"type": "string", "not": {"const": "x"}}, "not is not supported at #"),
        (
            {"properties": {"a": {"type": "integer", "multipleOf": 3}}},
            "multipleOf 3 is not supported at #/properties/a",
        ),
        (
            {"type": "array", "items": {"uniqueItems": True, "type": "array", "minItems": 2}},
            "uniqueItems with minItems above 1 is not supported at #/items",
        ),
        (
            {"properties": {"a": {}}, "dependencies": {"a": {"required": ["b"]}}},
            "dependencies with a schema",
        ),
        (
            {"type": "object", "propertyNames": {"maxLength": 3}},
            "propertyNames is not supported at #",
        ),
        (
            {"properties": {"a": {"type": "array", "contains": {}}}},
            "contains is not supported at #/properties/a",
        ),
        ({"if": {}, "then": {"type": "integer"}}, "then is not supported at #"),
        (
            {"oneOf": [{"type": "integer"}, {"type": "number"}]},
            "oneOf at #: branches 0 and 1 may both match",
        ),
        (
            {"oneOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
            "branches 0 and 1 may both match",
        ),
        (
            {"type": "string", "format": "duration"},
            "format 'duration' is not supported at #/format",
        ),
        ({"type": "string", "format": "date", "maxLength": 5}, "format together with maxLength"),
        (
            {"type": "string", "pattern": "(?=a)"},
            "pattern at #/pattern: lookahead is not supported",
        ),
        ({"$ref": "other.json#/a"}, "only local references"),
        ({"$ref": "#/$defs/missing"}, "$ref #/$defs/missing not found at #"),
        ({"properties": 5}, "properties has an invalid value 5 at #/properties"),
        ({"type": "strin"}, "unknown type"),
        (
            {"type": "object", "patternProperties": {"^x": {}, "^y": {}}},
            "more than one pattern is not supported at #",
        ),
        (
            {"properties": {"xa": {}}, "patternProperties": {"^x": {}}},
            "patternProperties is not supported at #",
        ),
        (
            {"type": "string", "pattern": "^a+$", "minLength": 2},
            "cannot combine it with minLength 2",
        ),
        (
            {"allOf": [{"type": "string", "pattern": "a"}, {"pattern": "b"}]},
            "allOf: cannot combine two different 'pattern'",
        ),
        ({"enum": []}, "allows no value"),
        # a boolean is not a number, though Python's False == 0 (found by test_reliability)
        ({"allOf": [{"enum": [False]}, {"enum": [0]}]}, "allows no value"),
        ({"allOf": [{"const": 1}, {"const": True}]}, "cannot combine two different 'const'"),
        ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "allows no value"),
        ({"type": "object", "additionalProperties": False, "minProperties": 1}, "allows no value"),
    ],
)
def test_refusals_name_the_keyword_and_path(schema, message):
    with pytest.raises(SchemaError, match=re.escape(message)):
        schema_to_regex(schema)


def test_enums_intersect_by_json_equality():
    assert schema_to_regex({"allOf": [{"enum": [1, True, "a"]}, {"enum": [1.0, "a"]}]}) == (
        '(?:1|"a")'
    )


def test_load_schema(tmp_path):
    path = tmp_path / "schema.json"
    path.write_text('{"type": "integer"}')
    assert load_schema(str(path)) == load_schema('{"type": "integer"}') == {"type": "integer"}
    for bad, message in [
        ("{nope", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        (str(tmp_path / "x"), "cannot read"),
    ]:
        with pytest.raises(SchemaError, match=message):
            load_schema(bad)
