"""Compile a JSON Schema to a regex in our dialect, so JSON output reuses the regex DFA and its
drafts.

    regex = schema_to_regex({"type": "object", "properties": {"name": {"type": "string"}},
                             "required": ["name"]})

The regex matches only JSON text that validates against the schema: where the exact set of texts is
out of reach, it matches a subset (properties in schema order, no undeclared properties, compact
whitespace, fractions only where the whole integer part is in range) or the schema is refused with a
`SchemaError` naming the keyword and its JSON pointer. Objects and arrays are written by
`json_containers.py`, leaves (strings, formats, number ranges) by `json_regex.py`. The limits
(docs/constrained.md, "Limits") are `schema_to_regex`'s arguments and the `MAX_*` budgets below,
checked while building, so any input is refused in one line before it can hold a request up for long
(benchmarks/results/reliability.md).
"""

import json
from fractions import Fraction

from constrained.json_containers import array_regex, object_regex
from constrained.json_regex import (
    BOOLEAN,
    FORMATS,
    INTEGER,
    NULL,
    NUMBER,
    STRING,
    bounded_string,
    integer_range,
    literal,
    number_range,
    pattern_string,
    whole_bounds,
)
from constrained.regex_dfa import compile_regex
from constrained.regex_parse import RegexError
from constrained.schema_keywords import (
    ALL_TYPES,
    ANNOTATIONS,
    TYPE_KEYWORDS,
    SchemaError,
    check_finite,
    check_supported,
    common_types,
    json_in,
    json_type,
    load_schema,
    pointer_get,
    same_json,
)

__all__ = ["SchemaError", "load_schema", "schema_to_regex"]

# characters of any part of the regex; the DFA caps (regex_dfa.py) bound the rest
MAX_REGEX_LENGTH = 500_000
MAX_DEPTH = 64  # subschemas nested in one another (each level also nests the regex's groups)
MAX_SUBSCHEMAS = 20_000  # subschemas compiled, counting every expansion of a $ref
MAX_BOUND = 10**309  # numeric bounds beyond ±1e308 (past float range) are refused


def schema_to_regex(
    schema, whitespace: str = "", max_ref_depth: int = 3, any_depth: int = 1, max_repeat: int = 64
) -> str:
    """The regex (our dialect, fullmatch) for JSON text that validates against `schema`.

    Args:
        schema: A JSON Schema as a dict (or True/False).
        whitespace: Regex for the whitespace allowed around `{ } [ ] , :`; "" is compact JSON.
        max_ref_depth: How often one `$ref` may be expanded along a path; deeper, the branch is left
            out (an optional property, an empty array, another `anyOf` branch) or the schema
            refused.
        any_depth: Nesting depth of arrays and objects where the schema allows any value.
        max_repeat: Largest `maxLength`/`maxItems` kept as is (each allowed length is DFA states);
            larger ones are lowered to it.
    """
    check_finite(schema)
    try:
        regex = _Compiler(schema, whitespace, max_ref_depth, any_depth, max_repeat).compile(
            schema, "#", ()
        )
    except RecursionError:  # a backstop: chains of $ref and oneOf are walked recursively
        raise SchemaError("the schema nests too deeply") from None
    if regex is None:
        raise SchemaError(
            "the schema allows no value that can be generated (false, empty enum or unbounded "
            "recursion)"
        )
    return regex


class _Compiler:
    """One schema's compilation: `resolve` and `merge` follow $ref and allOf, `compile` and the
    keyword methods below it write the regex (objects and arrays in `json_containers.py`, with this
    compiler handed in), and `check_exclusive` makes sure oneOf's branches exclude each other."""

    def __init__(self, root, whitespace, max_ref_depth, any_depth, max_repeat):
        self.root = root
        ws = f"(?:{whitespace})" if whitespace else ""
        self.ws, self.comma, self.colon = ws, f"{ws},{ws}", f"{ws}:{ws}"
        self.max_ref_depth, self.any_depth, self.max_repeat = max_ref_depth, any_depth, max_repeat
        self._any = {}  # depth -> any_value(depth)
        self.depth, self.subschemas = 0, 0  # subschemas open now, and compiled so far: the budgets

    def resolve(self, schema, path, refs):
        """Follow a `$ref` (siblings are merged, as allOf); returns (schema, refs), schema None when
        cut."""
        while isinstance(schema, dict) and "$ref" in schema:
            ref = schema["$ref"]
            if not isinstance(ref, str) or not ref.startswith("#"):
                raise SchemaError(
                    f"$ref {ref!r} at {path}: only local references (#/...) are supported"
                )
            if refs.count(ref) >= self.max_ref_depth:
                return None, refs
            target = pointer_get(self.root, ref[1:], path)
            siblings = {
                key: value
                for key, value in schema.items()
                if key != "$ref" and key not in ANNOTATIONS
            }
            refs = refs + (ref,)
            schema = self.merge(target, siblings, path, refs) if siblings else target
        return schema, refs

    def merge(self, first, second, path, refs):
        """allOf of two schemas as one schema, where their keywords combine; else SchemaError."""
        first, refs = self.resolve(first, path, refs)
        second, refs = self.resolve(second, path, refs)
        if first is None or second is None or first is False or second is False:
            return False
        if first is True or second is True:
            return second if first is True else first
        merged = dict(first)
        for key, value in second.items():
            if key in ANNOTATIONS or same_json(merged.get(key, value), value):
                merged.setdefault(key, value)
            elif key == "properties":
                merged[key] = {
                    **merged[key],
                    **{
                        name: ({"allOf": [merged[key][name], sub]} if name in merged[key] else sub)
                        for name, sub in value.items()
                    },
                }
            elif key == "required":
                merged[key] = list(dict.fromkeys(merged[key] + value))
            elif key == "type":
                merged[key] = common_types(merged[key], value)
            elif key in ("minimum", "minLength", "minItems", "minProperties") and not isinstance(
                value, bool
            ):
                merged[key] = max(merged[key], value)
            elif key in ("maximum", "maxLength", "maxItems", "maxProperties") and not isinstance(
                value, bool
            ):
                merged[key] = min(merged[key], value)
            elif key == "enum":
                merged[key] = [item for item in merged[key] if json_in(item, value)]
            elif key == "allOf":
                merged[key] = merged[key] + value
            elif key in ("items", "additionalProperties") and isinstance(value, dict):
                merged[key] = {"allOf": [merged[key], value]}
            else:
                raise SchemaError(f"allOf: cannot combine two different {key!r} at {path}")
        # in one part only
        extra = set(first.get("properties", {})) ^ set(second.get("properties", {}))
        if extra and any("additionalProperties" in part for part in (first, second)):
            raise SchemaError(
                f"allOf: additionalProperties with properties from another part at {path}"
            )
        return merged

    def compile(self, schema, path, refs):
        """The regex for `schema` at JSON pointer `path`, or None when no value can be generated."""
        self.subschemas += 1
        if self.subschemas > MAX_SUBSCHEMAS:
            raise SchemaError(
                f"the schema is too large: more than {MAX_SUBSCHEMAS} subschemas to compile "
                f"(counting each expansion of a $ref), the last at {path}"
            )
        if self.depth >= MAX_DEPTH:
            raise SchemaError(f"the schema nests more than {MAX_DEPTH} levels deep at {path}")
        self.depth += 1
        try:
            regex = self.compile_node(schema, path, refs)
        finally:
            self.depth -= 1
        if regex is not None:
            self.check_length(len(regex), path)
        return regex

    @staticmethod
    def check_length(length, path):
        """Refuse a part of the regex over the size budget, as soon as it is known to be."""
        if length > MAX_REGEX_LENGTH:
            raise SchemaError(
                f"the schema is too large: its regex passes {MAX_REGEX_LENGTH} characters at {path}"
            )

    def compile_node(self, schema, path, refs):
        schema, refs = self.resolve(schema, path, refs)
        if schema is None or schema is False:
            return None
        if schema is True:
            return self.any_value(self.any_depth)
        if not isinstance(schema, dict):
            raise SchemaError(f"a schema must be an object or a boolean at {path}")
        check_supported(schema, path)
        if "allOf" in schema:
            merged = {key: value for key, value in schema.items() if key != "allOf"}
            for index, part in enumerate(schema["allOf"]):
                merged = self.merge(merged, part, f"{path}/allOf/{index}", refs)
            return self.compile(merged, path, refs)
        for keyword in ("anyOf", "oneOf"):
            if keyword in schema:
                return self.alternatives(schema, keyword, path, refs)
        if "const" in schema or "enum" in schema:
            return self.enum(schema, path, refs)
        types = self.types_to_emit(schema, path)
        # no type keyword at all: any value, nesting bounded
        if "type" not in schema and types == ALL_TYPES:
            return self.any_value(self.any_depth)
        options = [self.typed(schema, name, path, refs) for name in types]
        options = [option for option in options if option is not None]
        return "(?:" + "|".join(options) + ")" if options else None

    def types_to_emit(self, schema, path):
        """The declared types; without `type`, the one its keywords describe (a subset), else
        any."""
        declared = schema.get("type")
        if declared is None:
            described = [name for name, keywords in TYPE_KEYWORDS.items() if keywords & set(schema)]
            return described[:1] or ALL_TYPES
        declared = [declared] if isinstance(declared, str) else declared
        if not all(name in ALL_TYPES + ["__none__"] for name in declared):
            raise SchemaError(f"unknown type {declared} at {path}/type")
        # "number" already covers integers; emitting both would only duplicate them.
        return [name for name in declared if not (name == "integer" and "number" in declared)]

    def typed(self, schema, name, path, refs):
        if name == "object":
            return object_regex(self, schema, path, refs)
        if name == "array":
            return array_regex(self, schema, path, refs)
        if name == "string":
            return self.string(schema, path)
        if name in ("number", "integer"):
            return self.number(schema, name, path)
        return {"boolean": BOOLEAN, "null": NULL}.get(name)

    def alternatives(self, schema, keyword, path, refs):
        siblings = {key: value for key, value in schema.items() if key != keyword}
        branches = [
            self.merge(siblings, branch, f"{path}/{keyword}/{i}", refs) if siblings else branch
            for i, branch in enumerate(schema[keyword])
        ]
        if keyword == "oneOf":
            self.check_exclusive(branches, path, refs)
        options = [
            self.compile(branch, f"{path}/{keyword}/{i}", refs) for i, branch in enumerate(branches)
        ]
        options = [option for option in options if option is not None]
        return "(?:" + "|".join(options) + ")" if options else None

    def enum(self, schema, path, refs):
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if "const" in schema and "enum" in schema:
            values = [value for value in values if json_in(value, schema["enum"])]
        rest = {
            key: value
            for key, value in schema.items()
            if key not in {"const", "enum"} | ANNOTATIONS
        }
        texts, length = [], 0
        # the budget as we go: a million-value enum stops after the first 500 kB
        for value in values:
            texts.append(literal(value))
            length += len(texts[-1]) + 1
            self.check_length(length, path)
        if rest:
            # Keep the values the rest of the schema accepts (its regex is a subset of the schema),
            # matched by our DFA, not Python's re: a `pattern` such as (a*)*b would make re
            # backtrack for ages.
            dfa = compile_regex(self.compile(rest, path, refs) or "(?!)")
            texts = [
                text
                for value, text in zip(values, texts)
                if dfa.matches(
                    json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
                )
            ]
        return "(?:" + "|".join(texts) + ")" if texts else None

    def string(self, schema, path):
        constraints = {"minLength", "maxLength", "pattern"} & set(schema)
        if "format" in schema and schema["format"] in FORMATS:
            if constraints:
                raise SchemaError(
                    f"format together with {sorted(constraints)[0]} is not supported at {path}"
                )
            return f'"{FORMATS[schema["format"]]}"'
        if "pattern" in schema:
            try:
                return pattern_string(
                    schema["pattern"], schema.get("minLength", 0), schema.get("maxLength")
                )
            except RegexError as error:
                raise SchemaError(f"pattern at {path}/pattern: {error}") from None
        least, most = schema.get("minLength", 0), schema.get("maxLength")
        if most is not None and least > most:
            return None
        if least == 0 and most is None:
            return STRING
        return bounded_string(
            least, None if most is None else min(most, max(least, self.max_repeat))
        )

    def number(self, schema, name, path):
        step = schema.get("multipleOf")
        if step is not None:
            # Every integer is a multiple of 1, 1/2, 1/4, ... (exact in binary, so a validator
            # agrees).
            exact = Fraction(step)
            if step <= 0 or exact.numerator != 1 or exact.denominator & (exact.denominator - 1):
                raise SchemaError(f"multipleOf {step} is not supported at {path}/multipleOf")
            name = "integer"
        lo, hi = schema.get("minimum"), schema.get("maximum")
        low, high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        lo_exclusive, hi_exclusive = low is True, high is True  # draft 4: flags on minimum/maximum
        if not isinstance(low, bool) and low is not None and (lo is None or low >= lo):
            lo, lo_exclusive = low, True
        if not isinstance(high, bool) and high is not None and (hi is None or high <= hi):
            hi, hi_exclusive = high, True
        if lo is None and hi is None:
            return INTEGER if name == "integer" else NUMBER
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            value = schema.get(key)
            if not isinstance(value, bool) and value is not None and abs(value) >= MAX_BOUND:
                raise SchemaError(f"{key} beyond ±1e308 is not supported at {path}/{key}")
        if name == "integer":
            return integer_range(*whole_bounds(lo, lo_exclusive, hi, hi_exclusive))
        return number_range(lo, lo_exclusive, hi, hi_exclusive)

    def any_value(self, depth):
        """Any JSON value, arrays and objects nested at most `depth` deep."""
        if depth not in self._any:
            options = [NULL, BOOLEAN, NUMBER, STRING]
            if depth > 0:
                inner = self.any_value(depth - 1)
                options.append(rf"\[{self.ws}(?:{inner}(?:{self.comma}{inner})*)?{self.ws}\]")
                member = f"{STRING}{self.colon}{inner}"
                options.append(rf"\{{{self.ws}(?:{member}(?:{self.comma}{member})*)?{self.ws}\}}")
            self._any[depth] = "(?:" + "|".join(options) + ")"
        return self._any[depth]

    def accepted_types(self, schema, refs, emitted):
        """Types of the values `schema` accepts (emitted=False) or that we emit for it (True)."""
        schema, refs = self.resolve(schema, "#", refs)
        if schema is None or schema is False:
            return set()
        if schema is True:
            return set(ALL_TYPES)
        if "const" in schema or "enum" in schema:
            return {
                json_type(value)
                for value in ([schema["const"]] if "const" in schema else schema["enum"])
            }
        for keyword in ("anyOf", "oneOf"):
            if keyword in schema:
                return set().union(
                    *(self.accepted_types(b, refs, emitted) for b in schema[keyword])
                )
        declared = schema.get("type")
        if declared is None:
            types = set(self.types_to_emit(schema, "#")) if emitted else set(ALL_TYPES)
        else:
            types = {declared} if isinstance(declared, str) else set(declared)
        # 1.0 is an integer to a validator, and our numbers include integers.
        return types | ({"integer", "number"} if types & {"integer", "number"} else set())

    def check_exclusive(self, branches, path, refs):
        """oneOf needs exactly one branch to match: refuse unless what each branch emits fails the
        others."""
        for i, mine in enumerate(branches):
            for j, other in enumerate(branches):
                if (
                    i != j
                    and self.accepted_types(mine, refs, True)
                    & self.accepted_types(other, refs, False)
                    and not self.discriminated(mine, other, refs)
                ):
                    raise SchemaError(
                        f"oneOf at {path}: branches {i} and {j} may both match; use anyOf"
                    )

    def discriminated(self, mine, other, refs):
        """True when `mine` always emits a required property whose const/enum values `other`
        forbids."""
        mine, other = (self.resolve(schema, "#", refs)[0] for schema in (mine, other))
        if not isinstance(mine, dict) or not isinstance(other, dict):
            return False
        for name in set(mine.get("required", [])) & set(other.get("required", [])):
            values = [
                self.resolve(s.get("properties", {}).get(name, {}), "#", refs)[0]
                for s in (mine, other)
            ]
            sets = [
                s.get("enum", [s["const"]] if "const" in s else None)
                if isinstance(s, dict)
                else None
                for s in values
            ]
            if all(v is not None for v in sets) and not any(json_in(v, sets[1]) for v in sets[0]):
                return True
        return False
