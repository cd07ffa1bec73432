"""Property: whatever schema a request gives, a generation that ends parses as JSON and
validates against it, greedy or sampled, plain or speculative (random schemas from a
small generator of what the converter, pymtp/schema_grammar.py, understands)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TINY_F16, shared_model

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a test extra: pip install -e '.[test]'")

NAMES = st.sampled_from(["id", "name", "tags", "ok", "size", "kind", "note", "items"])

leaf = st.one_of(
    st.builds(lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
              st.integers(0, 2), st.integers(0, 6)),
    st.just({"type": "integer"}),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.sampled_from(["red", "green", "blue", 1, 2, None]), min_size=1, max_size=4, unique=True)
      .map(lambda values: {"enum": values}),
    st.sampled_from(["on", 7, True]).map(lambda v: {"const": v}),
    # what schema_grammar.py added to the converter: bounds of an integer, nullable types,
    # values that need escaping, a pattern's class escapes
    st.builds(lambda lo, width: {"type": "integer", "minimum": lo, "maximum": lo + width},
              st.integers(-150, 150), st.integers(0, 300)),
    # a string bounded too: at T=1 an unbounded one ran past max_tokens (seed 57, session 57)
    st.sampled_from(["string", "integer", "boolean"]).map(
        lambda t: {"type": [t, "null"], **({"maxLength": 12} if t == "string" else {})}),
    st.just({"type": ["string", "null"], "maxLength": 3}),
    st.just({"enum": ["c\\d", 'a"b', "x/y"]}),
    st.just({"type": "string", "pattern": "^[a-z]{1,4}\\.\\d{2}$"}),
)


def _array(items):
    return st.builds(lambda lo, extra, it: {"type": "array", "items": it, "minItems": lo, "maxItems": lo + extra},
                     st.integers(0, 1), st.integers(0, 2), items)


def _object(values, all_required=False):
    """Objects of 1-4 properties; the top level requires all of them (an optional one is
    mostly left out, which would test little)."""
    props = st.dictionaries(NAMES, values, min_size=1, max_size=4)
    return props.flatmap(lambda p: st.builds(
        lambda required: {"type": "object", "properties": p, "required": sorted(required),
                          "additionalProperties": False},
        st.just(set(p)) if all_required else st.sets(st.sampled_from(sorted(p)), max_size=len(p))))


inner = st.one_of(leaf, _array(leaf), st.lists(leaf, min_size=2, max_size=2).map(lambda s: {"anyOf": s}))
SCHEMAS = _object(st.one_of(inner, _object(leaf), _array(_object(leaf))), all_required=True)


@pytest.fixture(scope="module")
def tiny():
    return shared_model(TINY_F16)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, mode=st.sampled_from([dict(spec="mtp", draft_max=3), dict(spec="mtp", draft_max=1),
                                             dict(spec="mtp", temperature=0.7), dict(spec="none", temperature=1.0)]),
       seed=st.integers(0, 2**16))
def test_every_output_validates_against_its_schema(tiny, schema, mode, seed):
    r = tiny.generate("The quick brown fox", json_schema=schema, max_tokens=400, seed=seed, **mode)
    assert r.finish_reason == "stop", (schema, r.text)      # bounded schemas end
    jsonschema.validate(json.loads(r.text), schema)
