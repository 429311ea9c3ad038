"""The request bodies (``proxy.bodies``, ``proxy.apis``): the legs' bodies, and request validation."""

from __future__ import annotations

import orjson
import pytest

from contract import wire
from proxy.apis.chat import Chat
from proxy.bodies import decode_body
from proxy.errors import InvalidRequest, ModelNotFound
from tests.unit.conftest import PROXY_MODEL
from tests.unit.proxy_factories import APIS, parse_request
from tests.unit.proxy_requests import CHAT, CHAT_PATH, COMPLETION, INVALID_REQUESTS, PREFILL_FIELDS

# --- proxy.bodies: the request bodies -----------------------------------------------------


def test_prefill_body_forces_one_token_no_stream_and_remote_decode():
    body = CHAT | {
        "max_tokens": 100,
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 3,
        "temperature": 0.5,
        "kv_transfer_params": {"do_remote_prefill": True},
    }
    original = orjson.loads(orjson.dumps(body))

    request = Chat().prefill_body(body)

    assert request == CHAT | {"temperature": 0.5} | PREFILL_FIELDS
    assert body == original  # the client's body is not touched
    params = wire.PREFILL_REQUEST_PARAMS
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False


def test_prefill_body_gives_each_request_its_own_kv_transfer_params():
    first, second = Chat().prefill_body(dict(CHAT)), Chat().prefill_body(dict(CHAT))
    first["kv_transfer_params"]["remote_engine_id"] = "mutated"

    assert second["kv_transfer_params"]["remote_engine_id"] is None
    assert wire.PREFILL_REQUEST_PARAMS["remote_engine_id"] is None


@pytest.mark.parametrize(("sent", "expected"), [(50, 1), (None, 1)])
def test_prefill_body_caps_max_completion_tokens_when_present(sent, expected):
    assert Chat().prefill_body(CHAT | {"max_completion_tokens": sent})["max_completion_tokens"] == expected
    assert "max_completion_tokens" not in Chat().prefill_body(dict(CHAT))


def test_prefill_body_drops_min_tokens():
    assert Chat().prefill_body(CHAT | {"min_tokens": 5, "max_tokens": 10}).get("min_tokens", 0) <= 1


def test_decode_body_is_the_clients_request_with_the_kv_transfer_params():
    body = CHAT | {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": 9}
    kv_params = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_block_ids": [[1, 2]]}

    request = decode_body(body, kv_params)

    assert request == body | {"kv_transfer_params": kv_params}
    assert "kv_transfer_params" not in body


@pytest.mark.parametrize("kv_params", [None, {}])
def test_decode_body_without_kv_transfer_params_is_the_clients_request(kv_params):
    body = CHAT | {"temperature": 0}
    request = decode_body(body, kv_params)

    assert request == body and request is not body


# --- proxy.bodies: validation -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_clients_kv_transfer_params_are_refused_naming_the_field(kind):
    body = (CHAT if kind == "chat" else COMPLETION) | {
        "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.0.0.9", "remote_port": 5600}
    }
    with pytest.raises(InvalidRequest, match="set by pdserve between its engines, never by a client") as caught:
        parse_request(orjson.dumps(body), kind, PROXY_MODEL)
    assert caught.value.param == "kv_transfer_params"


def test_decode_body_never_carries_anything_but_the_prefills_params():
    body = CHAT | {"kv_transfer_params": {"remote_host": "10.0.0.9"}}
    assert "kv_transfer_params" not in decode_body(body, None)
    assert decode_body(body, {"remote_host": "198.18.0.11"})["kv_transfer_params"] == {"remote_host": "198.18.0.11"}


def test_parse_request_returns_the_body_with_unknown_fields_kept():
    sent = CHAT | {"temperature": 0.1, "ignore_eos": True, "chat_template_kwargs": {"x": 1}}
    assert parse_request(orjson.dumps(sent), "chat", PROXY_MODEL) == sent


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_parse_request_accepts_every_prompt_form(prompt):
    sent = {"model": PROXY_MODEL, "prompt": prompt}
    assert parse_request(orjson.dumps(sent), "completion", PROXY_MODEL) == sent


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"null", b"[]", b'"text"', b"\xff"],
    ids=["empty", "truncated", "null", "list", "string", "not-utf8"],
)
def test_parse_request_rejects_what_is_not_a_json_object(raw):
    with pytest.raises(InvalidRequest) as caught:
        parse_request(raw, "chat", PROXY_MODEL)
    assert (caught.value.status, caught.value.param) == (400, None)


@pytest.mark.parametrize(("path", "sent", "param"), INVALID_REQUESTS)
def test_parse_request_names_the_invalid_parameter(path, sent, param):
    kind = "chat" if path == CHAT_PATH else "completion"
    with pytest.raises(InvalidRequest) as caught:
        parse_request(orjson.dumps(sent), kind, PROXY_MODEL)
    assert caught.value.param == param
    assert caught.value.body()["error"]["param"] == param


def test_parse_request_unknown_model():
    with pytest.raises(ModelNotFound) as caught:
        parse_request(orjson.dumps(CHAT | {"model": "other"}), "chat", PROXY_MODEL)
    assert (caught.value.status, caught.value.code, caught.value.param) == (404, "model_not_found", "model")


PLAIN_CHECK_BODIES = [
    ("chat", CHAT),
    ("chat", CHAT | {"stream": True, "n": None, "max_tokens": 5, "max_completion_tokens": 7}),
    ("chat", CHAT | {"max_tokens": 5.0}),
    ("chat", CHAT | {"max_tokens": "5"}),
    ("chat", CHAT | {"max_tokens": True}),
    ("chat", CHAT | {"n": 0}),
    ("chat", CHAT | {"stream": "true"}),
    ("chat", CHAT | {"messages": []}),
    ("chat", CHAT | {"messages": ["hi"]}),
    ("chat", CHAT | {"model": ""}),
    ("chat", CHAT | {"model": 7}),
    ("chat", {"messages": CHAT["messages"]}),
    ("completion", COMPLETION),
    ("completion", COMPLETION | {"prompt": ""}),
    ("completion", COMPLETION | {"prompt": []}),
    ("completion", COMPLETION | {"prompt": ["a", "b"]}),
    ("completion", COMPLETION | {"prompt": [1, 2]}),
    ("completion", COMPLETION | {"prompt": [[1, 2], []]}),
    ("completion", COMPLETION | {"prompt": [1, "a"]}),
    ("completion", COMPLETION | {"prompt": [1.0, 2]}),
    ("completion", COMPLETION | {"prompt": 5}),
    ("completion", COMPLETION | {"prompt": [[1, "a"]]}),
    ("completion", COMPLETION | {"max_completion_tokens": 0}),  # not a completions parameter: passes through
]


@pytest.mark.parametrize(("kind", "body"), PLAIN_CHECK_BODIES)
def test_the_quick_check_accepts_only_what_the_request_models_accept(kind, body):
    from pydantic import ValidationError

    try:
        APIS[kind].request_model.model_validate(body)
        valid = True
    except ValidationError:
        valid = False
    assert not APIS[kind].plainly_valid(body) or valid
    # and the result of parse_request never depends on which of the two decided
    try:
        parsed = parse_request(orjson.dumps(body), kind, body.get("model") or "x")
        assert valid and parsed == body
    except InvalidRequest:
        assert not valid
    except ModelNotFound:
        assert valid


def test_the_quick_check_takes_the_usual_bodies():
    assert APIS["chat"].plainly_valid(CHAT | {"stream": True, "max_tokens": 9, "temperature": 0.1})
    assert APIS["completion"].plainly_valid(COMPLETION | {"prompt": [[1, 2], [3]]})


@pytest.mark.parametrize("stream", [True, False, None])
def test_parse_request_accepts_boolean_or_null_stream(stream):
    assert parse_request(orjson.dumps(CHAT | {"stream": stream}), "chat", PROXY_MODEL)["stream"] is stream
