"""What a JSON Schema may hold, for `json_schema.py`: keyword tables, value checks, loading,
pointers.

Keywords are sorted into annotations (ignored), supported ones (by type) and unsupported ones that
constrain values (refused with their JSON pointer, never dropped).
"""

import json
import math
from pathlib import Path

from constrained.regex_parse import RegexError

ANNOTATIONS = {
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "id",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
    "definitions",
    "$defs",
    "contentMediaType",
    "contentEncoding",
    "$anchor",
}
# Keywords that constrain values and that no branch below implements: refused, never dropped.
UNSUPPORTED = {
    "not",
    "contains",
    "minContains",
    "maxContains",
    "propertyNames",
    "dependentSchemas",
    "unevaluatedProperties",
    "unevaluatedItems",
    "$dynamicRef",
    "$recursiveRef",
    "then",
    "else",
}
# Formats a validator checks that have no regex here; other format names are annotations.
UNSUPPORTED_FORMATS = {"duration", "regex", "json-pointer", "relative-json-pointer", "uri-template"}
TYPE_KEYWORDS = {
    "object": {
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "minProperties",
        "maxProperties",
        "dependencies",
        "dependentRequired",
    },
    "array": {"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems"},
    "string": {"minLength", "maxLength", "pattern", "format"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
}
# What each keyword's value must be; a schema that breaks this is not a valid schema.
KEYWORD_TYPES = {
    "properties": dict,
    "patternProperties": dict,
    "required": list,
    "enum": list,
    "allOf": list,
    "anyOf": list,
    "oneOf": list,
    "prefixItems": list,
    "type": (str, list),
    "pattern": str,
    "format": str,
    "$ref": str,
    "items": (dict, bool, list),
    "additionalItems": (dict, bool),
    "additionalProperties": (dict, bool),
    "minLength": int,
    "maxLength": int,
    "minItems": int,
    "maxItems": int,
    "minProperties": int,
    "maxProperties": int,
    "minimum": (int, float),
    "maximum": (int, float),
    "multipleOf": (int, float),
    "exclusiveMinimum": (int, float, bool),
    "exclusiveMaximum": (int, float, bool),
    "uniqueItems": bool,
}
ALL_TYPES = ["object", "array", "string", "number", "integer", "boolean", "null"]


class SchemaError(RegexError):
    """A schema that is not valid, or asks for something the compiler cannot guarantee."""


def load_schema(argument: str):
    """A schema from a file path or inline JSON text (the `--json-schema` argument); SchemaError if
    invalid."""
    text = argument
    if not argument.lstrip().startswith(("{", "[")) and argument.strip() not in ("true", "false"):
        try:
            text = Path(argument).read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise SchemaError(
                f"cannot read the schema file {argument}: "
                f"{getattr(error, 'strerror', None) or error}"
            ) from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as error:
        raise SchemaError(f"the schema is not valid JSON: {error}") from None
    except ValueError as error:  # an integer of more than 4300 digits (Python's int limit)
        raise SchemaError(f"the schema has a number Python cannot read: {error}") from None
    except RecursionError:  # json's C parser recurses once per nested [ or {
        raise SchemaError("the schema nests too deeply to read") from None
    if not isinstance(schema, (dict, bool)):
        raise SchemaError("the schema must be a JSON object or a boolean")
    # here, not only in the regex compiler: every engine reads what this returns
    check_finite(schema)
    return schema


def check_finite(schema):
    """SchemaError naming the JSON pointer of a NaN or an infinity anywhere in `schema`. Python's
    json reads `NaN`, `Infinity` and numbers beyond double range (`1e400`) as such floats; they are
    no JSON a validator could compare against. The walk keeps its own stack: no depth limit."""
    stack = [(schema, "#")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            raise SchemaError(
                f"a number that is not finite (NaN, Infinity or beyond ±1.8e308) at {path}"
            )
        children = (
            node.items()
            if isinstance(node, dict)
            else enumerate(node)
            if isinstance(node, list)
            else ()
        )
        # Only containers and floats can hold a non-finite number: skip the rest without a pointer.
        stack += [
            (value, f"{path}/{escape(str(key))}")
            for key, value in children
            if isinstance(value, (dict, list, float))
        ]


def escape(key: str) -> str:
    """A key as one JSON pointer segment."""
    return key.replace("~", "~0").replace("/", "~1")


def pointer_get(root, pointer: str, path: str):
    """The node at a JSON pointer ("/$defs/node") in `root`; SchemaError if there is none."""
    node = root
    for part in pointer.lstrip("/").split("/") if pointer else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise SchemaError(f"$ref #{pointer} not found at {path}")
    return node


def valid_value(key, value) -> bool:
    """Whether a keyword's value has the JSON type the specification asks for."""
    expected = KEYWORD_TYPES.get(key)
    if expected is None:
        return True
    expected = expected if isinstance(expected, tuple) else (expected,)
    if isinstance(value, bool) and bool not in expected:  # True is an int to isinstance
        return False
    return isinstance(value, expected) and not (expected == (int,) and value < 0)  # counts are >= 0


def json_type(value) -> str:
    """The JSON Schema type of a JSON value (1.0 is an integer, as validators count it)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object", type(None): "null"}[
        type(value)
    ]


def same_json(first, second) -> bool:
    """JSON Schema's equality: a boolean is not a number (Python's ``False == 0``), while 1 equals
    1.0; arrays and objects compare member by member."""
    if isinstance(first, bool) or isinstance(second, bool):
        return isinstance(first, bool) and isinstance(second, bool) and first == second
    if isinstance(first, list) and isinstance(second, list):
        return len(first) == len(second) and all(map(same_json, first, second))
    if isinstance(first, dict) and isinstance(second, dict):
        return first.keys() == second.keys() and all(same_json(first[k], second[k]) for k in first)
    numbers = (int, float)
    if isinstance(first, numbers) and isinstance(second, numbers):
        return first == second
    return type(first) is type(second) and first == second


def json_in(value, values) -> bool:
    """Whether ``value`` is one of ``values`` by JSON Schema's equality (``same_json``)."""
    return any(same_json(value, other) for other in values)


def common_types(first, second) -> list:
    """The types two `type` values share (["__none__"] if none), for allOf."""

    def expand(types):
        types = {types} if isinstance(types, str) else set(types)
        return types | ({"integer"} if "number" in types else set())

    common = expand(first) & expand(second)
    return [name for name in ALL_TYPES if name in common] or ["__none__"]


def check_supported(schema, path):
    """SchemaError for a keyword with an invalid value, or one that constrains values and is not
    supported."""
    for key, value in schema.items():
        if not valid_value(key, value):
            raise SchemaError(
                f"{key} has an invalid value {json.dumps(value)[:40]} at {path}/{key}"
            )
        if key in UNSUPPORTED and not (key in ("then", "else") and "if" not in schema):
            raise SchemaError(f"{key} is not supported at {path}")
    if schema.get("format") in UNSUPPORTED_FORMATS:
        raise SchemaError(f"format {schema['format']!r} is not supported at {path}/format")
