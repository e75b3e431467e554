"""Regexes for JSON objects and arrays, the containers of `json_schema.py`'s schema walk.

Each function takes the walk's compiler, which gives the subschemas' regexes (`compiler.compile`),
the whitespace pieces (`ws`, `comma`, `colon`), the repeat cap (`max_repeat`) and the regex size
budget (`check_length`). Objects write their declared properties in schema order; arrays write
their prefix items, then the rest, with `minItems`/`maxItems` as nested optional groups.
"""

import json

from constrained.json_regex import STRING, literal, pattern_string
from constrained.regex_dfa import compile_regex
from constrained.regex_parse import RegexError
from constrained.schema_keywords import SchemaError, escape


def object_regex(compiler, schema, path, refs):
    """The regex for `schema` as an object, or None when no object validates."""
    properties = dict(schema.get("properties", {}))
    required = list(schema.get("required", []))
    additional = schema.get("additionalProperties", True)
    patterns = schema.get("patternProperties", {})
    dependencies = {**schema.get("dependencies", {}), **schema.get("dependentRequired", {})}
    ws = compiler.ws
    if not properties and not required:
        if dependencies:
            raise SchemaError(
                f"dependencies without declared properties are not supported at {path}"
            )
        members = map_members(compiler, additional, patterns, schema, path, refs)
        return None if members is None else rf"\{{{ws}{members}{ws}\}}"
    # we emit only declared properties: a pattern matters if one matches it
    for pattern in patterns:
        if any(pattern_matches(pattern, name, f"{path}/patternProperties") for name in properties):
            raise SchemaError(f"patternProperties is not supported at {path}/patternProperties")
    apply_dependencies(dependencies, properties, required, path)
    entries, length = [], 0
    for name in list(properties) + [name for name in required if name not in properties]:
        value = compiler.compile(
            properties.get(name, additional), f"{path}/properties/{escape(name)}", refs
        )
        if value is None and name in required:
            return None
        if value is not None:
            entries.append((f"{literal(name)}{compiler.colon}{value}", name in required))
            length += len(entries[-1][0])
            compiler.check_length(length, path)  # every member is written at least once: stop now
    count = sum(req for _, req in entries), len(entries)
    if (
        schema.get("minProperties", 0) > count[0]
        or schema.get("maxProperties", count[1]) < count[1]
    ):
        raise SchemaError(f"minProperties/maxProperties beyond the declared properties at {path}")
    return rf"\{{{ws}{members_in_order(entries, compiler.comma)}{ws}\}}"


def members_in_order(entries, comma):
    """Members in order with commas right: the optional ones before the first required member are
    `some_of`, every later one is `(?:,member)?`. `entries` are (member regex, required) pairs."""
    if not entries:
        return ""
    first_required = next((i for i, (_, req) in enumerate(entries) if req), len(entries))
    leading = [member for member, _ in entries[:first_required]]
    if first_required == len(entries):
        return f"(?:{some_of(leading, comma)})?"
    head = f"(?:{some_of(leading, comma)}{comma})?" if leading else ""
    rest = "".join(
        f"{comma}{member}" if req else f"(?:{comma}{member})?"
        for member, req in entries[first_required + 1 :]
    )
    return head + entries[first_required][0] + rest


def some_of(members, comma):
    """One or more of `members`, in order, comma-separated: each member written once. Some of the
    first k is some of the first k-1 (then maybe the k-th) or the k-th alone (naming each possible
    first member would write n^2/2). The groups nest n deep, which our parser handles (Python's `re`
    stops near 300)."""
    # (?:(?:m1(?:,m2)?|m2)(?:,m3)?|m3): the opening groups first, so no prefix is copied again.
    return (
        "(?:" * (len(members) - 1)
        + members[0]
        + "".join(f"(?:{comma}{member})?|{member})" for member in members[1:])
    )


def pattern_matches(pattern, name, path):
    """re.search(pattern, name) through our DFA: Python's re can backtrack for ages on (a*)*b."""
    try:
        return compile_regex(pattern_string(pattern)).matches(
            json.dumps(name, ensure_ascii=False).encode()
        )
    except RegexError as error:
        raise SchemaError(f"{path}: {error}") from None


def apply_dependencies(dependencies, properties, required, path):
    """ "a needs b": make b required where a is; leave out an optional a whose needs are not all
    required."""
    for name, needed in dependencies.items():
        if not isinstance(needed, list):
            raise SchemaError(
                f"dependencies with a schema are not supported at {path}/dependencies/{name}"
            )
    while True:  # required names first, to a fixed point: they decide which optional ones can stay
        before = len(required)
        for name, needed in dependencies.items():
            if name in required:
                required += [item for item in needed if item not in required]
        if len(required) == before:
            break
    for name, needed in dependencies.items():
        if name in properties and name not in required and not set(needed) <= set(required):
            del properties[name]


def map_members(compiler, additional, patterns, schema, path, refs):
    """Any keys (or keys matching the one patternProperties pattern), each with a valid value. A
    repeated key is harmless: whichever value a parser keeps is valid."""
    if schema.get("minProperties", 0) > 1:
        raise SchemaError(
            f"minProperties above 1 without declared properties is not supported at {path}"
        )
    if len(patterns) > 1:
        raise SchemaError(
            f"patternProperties with more than one pattern is not supported at {path}"
        )
    key, value = STRING, None
    # keys of the pattern only: additionalProperties is then moot
    for pattern, sub in patterns.items():
        try:
            key = pattern_string(pattern)
        except RegexError as error:
            raise SchemaError(f"patternProperties at {path}: {error}") from None
        value = compiler.compile(sub, f"{path}/patternProperties/{pattern}", refs)
    if not patterns:
        value = compiler.compile(additional, f"{path}/additionalProperties", refs)
    most = schema.get("maxProperties")
    if value is None or most == 0:
        return None if schema.get("minProperties", 0) else ""
    member = f"{key}{compiler.colon}{value}"
    repeat = "*" if most is None else f"{{0,{most - 1}}}"
    body = f"{member}(?:{compiler.comma}{member}){repeat}"
    return body if schema.get("minProperties", 0) == 1 else f"(?:{body})?"


def array_regex(compiler, schema, path, refs):
    """The regex for `schema` as an array, or None when no array validates."""
    ws, comma = compiler.ws, compiler.comma
    items = schema.get("items")
    if isinstance(items, list):  # draft 4-7 tuples
        prefix, rest, rest_path = items, schema.get("additionalItems", True), "additionalItems"
    else:
        prefix, rest, rest_path = (
            schema.get("prefixItems", []),
            True if items is None else items,
            "items",
        )
    least, most = schema.get("minItems", 0), schema.get("maxItems")
    if schema.get("uniqueItems") is True:  # at most one item is always unique
        if least > 1:
            raise SchemaError(
                f"uniqueItems with minItems above 1 is not supported at {path}/uniqueItems"
            )
        most = 1 if most is None else min(most, 1)
    if prefix and items is None:
        most = max(len(prefix), least) if most is None else most  # no undeclared items needed
    prefix_regexes = []
    for index, sub in enumerate(prefix[:most]):
        regex = compiler.compile(sub, f"{path}/prefixItems/{index}", refs)
        if regex is None:
            break
        prefix_regexes.append(regex)
    rest_regex = compiler.compile(rest, f"{path}/{rest_path}", refs)
    if len(prefix_regexes) < len(prefix[:most]) or rest_regex is None:
        most = len(prefix_regexes) if most is None else min(most, len(prefix_regexes))
    if most is not None:
        most = min(most, max(least, compiler.max_repeat))
        if least > most:
            return None
    if most == 0:
        return rf"\[{ws}{ws}\]"
    positions = prefix_regexes[:most]
    tail = ""
    if most is None or most > len(positions):
        low = max(least - len(positions), 0)
        high = "" if most is None else most - len(positions)
        if not positions:  # the first item has no comma before it
            positions, low, high = [rest_regex], max(low - 1, 0), "" if most is None else high - 1
        if high != 0:
            tail = f"(?:{comma}{rest_regex}){{{low},{high}}}"
    # Items from index `least` on are optional, each with everything after it: nested groups,
    # written opening parts first (one join, not a copy of the tail per item).
    opening = "".join(
        ("" if index < least else "(?:") + (comma if index else "") + regex
        for index, regex in enumerate(positions)
    )
    content = opening + tail + ")?" * max(len(positions) - least, 0)
    return rf"\[{ws}{content}{ws}\]"
