"""Property-based tests of the proxy's request validation (``GenerationApi.check``, ``proxy.apis``).

Hypothesis builds JSON objects around the fields the proxy relies on (every
JSON value for each, often the right type, sometimes absent) and checks:

- ``parse_request`` either accepts a body, and then the fields the proxy uses
  have the types it assumes, or raises ``InvalidRequest`` / ``ModelNotFound``
  with an OpenAI error body: never another exception;
- ``plainly_valid`` (the fast path) never accepts what the pydantic request
  models reject, and so the proxy accepts exactly what the models accept.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from proxy.errors import InvalidRequest, ModelNotFound
from tests.unit.proxy_factories import APIS, parse_request

MODEL = "m"
KINDS = ("chat", "completion")
PROPERTY_SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip
counts = st.integers(min_value=-2, max_value=2**70) | st.floats(allow_nan=False, allow_infinity=False) | json_values
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from([MODEL, "other", ""]) | json_values,
    "stream": st.booleans() | st.none() | json_values,
    "max_tokens": counts,
    "max_completion_tokens": counts,
    "n": counts,
    "messages": st.lists(st.dictionaries(st.text(max_size=6), json_values, max_size=3), max_size=3) | json_values,
    "prompt": st.text(max_size=6)
    | st.lists(st.integers(-(2**70), 2**70), max_size=4)
    | st.lists(st.lists(st.integers(), max_size=3), max_size=3)
    | st.lists(st.text(max_size=4), max_size=3)
    | json_values,
}


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    body = {name: draw(strategy) for name, strategy in FIELDS.items() if draw(st.booleans())}
    return body | draw(st.dictionaries(st.text(max_size=6), json_values, max_size=2))


def assert_openai_error_body(error: InvalidRequest | ModelNotFound) -> None:
    body = error.body()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert error.status in (400, 404)


def models_accept(body: dict[str, Any], kind: str) -> bool:
    try:
        APIS[kind].request_model.model_validate(body)
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize("kind", KINDS)
@PROPERTY_SETTINGS
@given(body=bodies())
def test_parse_request_accepts_well_typed_bodies_or_raises_an_openai_error(kind, body):
    raw = json.dumps(body).encode()  # not orjson: it cannot write integers past 64 bits, which clients may send
    try:
        parsed = parse_request(raw, kind, MODEL)
    except (InvalidRequest, ModelNotFound) as e:
        assert_openai_error_body(e)
        return

    assert parsed["model"] == MODEL
    assert parsed.get("stream") in (None, True, False)
    assert models_accept(parsed, kind)
    if kind == "chat":
        assert type(parsed["messages"]) is list and parsed["messages"]
        assert all(isinstance(message, dict) for message in parsed["messages"])
    else:
        assert isinstance(parsed["prompt"], str | list)


@pytest.mark.parametrize("kind", KINDS)
@PROPERTY_SETTINGS
@given(body=bodies())
def test_the_fast_path_never_accepts_what_the_models_reject(kind, body):
    if APIS[kind].plainly_valid(body):
        assert models_accept(body, kind)


@pytest.mark.parametrize("kind", KINDS)
@PROPERTY_SETTINGS
@given(body=bodies())
def test_the_proxy_accepts_exactly_what_the_models_accept(kind, body):
    raw = json.dumps(body | {"model": MODEL}).encode()
    try:
        parse_request(raw, kind, MODEL)
        accepted = True
    except InvalidRequest:
        accepted = False
    # What the proxy reads (orjson: no NaN, no integer past 64 bits) is what the models judge.
    try:
        read = orjson.loads(raw)
    except orjson.JSONDecodeError:
        assert not accepted
        return
    assert accepted == models_accept(read, kind)
