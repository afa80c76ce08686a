"""Hypothesis strategy for valid JSON Schemas (draft 2020-12, checked against the metaschema) of
the kinds tool parameters use, including the awkward corners: boolean subschemas, `$ref` into
`$defs`, `anyOf`/`oneOf`/`allOf`, enums and consts of any JSON value, nullable type lists,
unsatisfiable bounds, regex patterns, formats llguidance does not know."""

from __future__ import annotations

import string
from typing import Any

import jsonschema
from hypothesis import strategies as st

NAMES = st.text(alphabet=string.ascii_letters + "_-", min_size=1, max_size=6)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000),
                    st.floats(allow_nan=False, allow_infinity=False, width=32), st.text(max_size=6))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(NAMES, inner, max_size=3)), max_leaves=5)
PATTERNS = st.sampled_from(["^[a-z]+$", "[0-9]{3}-[0-9]{4}", "^(foo|bar)*$", "a{2,5}", ".*", "^\\w+@\\w+\\.com$",
                            "[^\\s]+", "(a|b|c){1,12}", "^[A-Za-z]+$"])
TYPES = st.sampled_from(["string", "integer", "number", "boolean", "null", "object", "array"])


def _string() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({"type": st.just("string")}, optional={
        "minLength": st.integers(0, 8), "maxLength": st.integers(0, 8), "pattern": PATTERNS,
        "format": st.sampled_from(["date-time", "date", "time", "email", "uri", "uuid", "ipv4", "hostname", "x-odd"]),
        "description": st.text(max_size=10)})


def _number() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({"type": st.sampled_from(["integer", "number"])}, optional={
        "minimum": st.integers(-50, 50), "maximum": st.integers(-50, 50), "exclusiveMinimum": st.integers(-50, 50),
        "exclusiveMaximum": st.integers(-50, 50), "multipleOf": st.integers(1, 7)})


LEAVES = st.one_of(
    st.booleans(),
    st.just({}),
    _string(),
    _number(),
    st.builds(lambda t: {"type": t}, TYPES),
    st.builds(lambda ts: {"type": ts}, st.lists(TYPES, min_size=1, max_size=3, unique=True)),
    st.builds(lambda vs: {"enum": vs}, st.lists(VALUES, min_size=1, max_size=4)),
    st.builds(lambda v: {"const": v}, VALUES),
    st.builds(lambda name: {"$ref": f"#/$defs/{name}"}, st.sampled_from(["a", "b"])),
)


def _extend(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    props = st.dictionaries(NAMES, inner, max_size=4)
    obj = st.builds(
        lambda p, req, extra: {"type": "object", "properties": p, "required": [k for k in p if k in req],
                               **({} if extra is None else {"additionalProperties": extra})},
        props, st.sets(NAMES, max_size=4), st.one_of(st.none(), st.booleans(), inner))
    arr = st.builds(lambda items, lo, hi: {"type": "array", "items": items, **lo, **hi}, inner,
                    st.sampled_from([{}, {"minItems": 1}, {"minItems": 3}]), st.sampled_from([{}, {"maxItems": 2}]))
    tup = st.builds(lambda items, extra: {"type": "array", "prefixItems": items, "items": extra},
                    st.lists(inner, min_size=1, max_size=3), st.one_of(st.booleans(), inner))
    combo = st.builds(lambda k, subs: {k: subs}, st.sampled_from(["anyOf", "oneOf", "allOf"]),
                      st.lists(inner, min_size=1, max_size=3))
    nullable = st.builds(lambda s: {"anyOf": [s, {"type": "null"}]}, inner)
    return st.one_of(obj, arr, tup, combo, nullable)


SUBSCHEMAS = st.recursive(LEAVES, _extend, max_leaves=12)


@st.composite
def tool_parameters(draw: st.DrawFn) -> dict[str, Any]:
    """A valid object schema with `$defs` a and b (which `$ref` leaves point at)."""
    schema = {"type": "object", "properties": draw(st.dictionaries(NAMES, SUBSCHEMAS, max_size=4)),
              "$defs": {"a": draw(SUBSCHEMAS), "b": draw(LEAVES.filter(lambda s: not (isinstance(s, dict) and "$ref" in s)))}}
    if draw(st.booleans()):
        schema["additionalProperties"] = draw(st.one_of(st.booleans(), SUBSCHEMAS))
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema
