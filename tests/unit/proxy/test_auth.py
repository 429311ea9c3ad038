"""API keys and the admin routes (``proxy.auth``, ``proxy.admin``) as a client meets them.

With keys configured (environment variables or a file), completion and
Responses API requests, ``/tokenize``, ``/detokenize`` and ``/v1/models`` need ``Authorization: Bearer <key>`` (else 401
``invalid_api_key``); ``/health`` and ``/metrics`` stay open. The admin
routes exist only with an admin key, and only an admin key opens them.
"""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from contract import wire
from proxy.app import ProxyConfig, create_app
from proxy.auth import KeyCheck, bearer_token, load_keys
from proxy.errors import ProxyConfigError
from tests.unit.proxy_requests import CHAT, CHAT_PATH, assert_openai_error

pytestmark = pytest.mark.timeout(15)

KEY, OTHER_KEY, ADMIN_KEY = "sk-test-key", "sk-other-key", "admin-secret"


@pytest.fixture(autouse=True)
def keys_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PD_KEY", KEY)
    monkeypatch.setenv("PD_OTHER_KEY", OTHER_KEY)
    monkeypatch.setenv("PD_ADMIN_KEY", ADMIN_KEY)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# --- API keys ---------------------------------------------------------------------------


ROUTES = {
    CHAT_PATH: CHAT,
    wire.RESPONSES_PATH: {"model": CHAT["model"], "input": "Hi"},
    wire.TOKENIZE_PATH: {"prompt": "Hi"},
    wire.DETOKENIZE_PATH: {"tokens": [1]},
}
"""Every route a client key opens that reaches an engine (``/v1/models``: ``test_models_needs_a_key_but_...``)."""


@pytest.mark.parametrize("path", list(ROUTES))
@pytest.mark.parametrize(
    "headers",
    [{}, bearer("sk-wrong"), bearer(KEY + "x"), {"Authorization": KEY}, bearer(ADMIN_KEY)],
    ids=["none", "wrong", "longer", "no-scheme", "admin-key"],
)
async def test_a_request_without_a_valid_key_is_401(make_client, prefill_engine, decode_engine, headers, path):
    client = await make_client(api_key_env=("PD_KEY",), admin_key_env=("PD_ADMIN_KEY",))

    response = await client.post(path, json=ROUTES[path], headers=headers | {"X-Request-Id": "nokey-1"})

    error = assert_openai_error(response, 401, error_type="invalid_request_error", code="invalid_api_key")
    assert KEY not in error["message"]
    assert response.headers["x-request-id"] == "nokey-1"
    assert prefill_engine.requests == decode_engine.requests == []


@pytest.mark.parametrize("key", [KEY, OTHER_KEY])
async def test_any_configured_key_is_accepted(make_client, decode_engine, key):
    client = await make_client(api_key_env=("PD_KEY", "PD_OTHER_KEY"))

    response = await client.post(CHAT_PATH, json=CHAT, headers=bearer(key))

    assert response.status_code == 200, response.text
    assert "authorization" not in decode_engine.requests[0].headers  # not forwarded


async def test_keys_from_a_file(make_client, tmp_path: Path):
    key_file = tmp_path / "keys"
    key_file.write_text(f"# the team's keys\n{KEY}\n\n  {OTHER_KEY}  \n")
    client = await make_client(api_key_file=str(key_file))

    assert (await client.post(CHAT_PATH, json=CHAT, headers=bearer(OTHER_KEY))).status_code == 200
    assert (await client.post(CHAT_PATH, json=CHAT, headers=bearer("# the team's keys"))).status_code == 401


async def test_models_needs_a_key_but_health_and_metrics_do_not(make_client):
    client = await make_client(api_key_env=("PD_KEY",))

    assert (await client.get("/v1/models")).status_code == 401
    assert (await client.get("/v1/models", headers=bearer(KEY))).status_code == 200
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/metrics")).status_code == 200


async def test_without_keys_no_key_is_needed(client):
    assert (await client.post(CHAT_PATH, json=CHAT)).status_code == 200


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"api_key_env": ("PD_UNSET",)}, "PD_UNSET"),
        ({"admin_key_file": "/nonexistent/keys"}, "/nonexistent/keys"),
    ],
)
def test_keys_that_cannot_be_read_stop_the_app_from_being_built(settings, message):
    with pytest.raises(ProxyConfigError, match=message):
        create_app(ProxyConfig(model_name="m", **settings))


def test_a_key_written_where_its_variables_name_belongs_is_refused_and_never_repeated(capsys):
    from orchestrator.cli import main

    with pytest.raises(pydantic.ValidationError, match="not the name of an environment variable") as info:
        ProxyConfig(model_name="m", api_key_env=("sk-literal-secret",))
    assert "sk-literal-secret" not in str(info.value.errors(include_input=False))

    with pytest.raises(SystemExit):
        main(["proxy", "--prefill", "http://p:1", "--decode", "http://d:1", "--api-key-env", "sk-literal-secret"])
    err = capsys.readouterr().err
    assert "--api-key-env: not the name of an environment variable" in err and "sk-literal" not in err


def test_an_empty_key_file_is_refused(tmp_path: Path):
    (tmp_path / "keys").write_text("# nothing yet\n")
    with pytest.raises(ProxyConfigError, match="holds no key"):
        load_keys(file=str(tmp_path / "keys"))


@pytest.mark.parametrize(
    ("header", "token"),
    [(None, None), ("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("Basic abc", None), ("Bearer", None)],
)
def test_bearer_token(header, token):
    assert bearer_token(header) == token


def test_key_check():
    check = KeyCheck((b"one", b"two"))
    assert check.allows("two") and not check.allows("tw") and not check.allows(None)
    assert KeyCheck(()).allows(None)


# --- admin routes -----------------------------------------------------------------------


@pytest.fixture
async def admin(make_client):
    return await make_client(api_key_env=("PD_KEY",), admin_key_env=("PD_ADMIN_KEY",))


async def test_admin_routes_do_not_exist_without_an_admin_key(make_client):
    client = await make_client(api_key_env=("PD_KEY",))

    response = await client.get("/admin/engines", headers=bearer(KEY))

    assert_openai_error(response, 404, error_type="invalid_request_error", code="404")


@pytest.mark.parametrize("headers", [{}, bearer(KEY), {"X-Admin-Key": "wrong"}], ids=["none", "api-key", "wrong"])
async def test_admin_routes_need_the_admin_key(admin, headers):
    for method, path in [("GET", "/admin/engines"), ("DELETE", "/admin/engines/decode-0")]:
        response = await admin.request(method, path, headers=headers)
        assert_openai_error(response, 401, error_type="invalid_request_error", code="invalid_api_key")


async def test_admin_lists_adds_drains_and_removes_engines(admin, pool, make_engine, prefill_engine, decode_engine):
    key = {"X-Admin-Key": ADMIN_KEY}
    listed = await admin.get("/admin/engines", headers=bearer(ADMIN_KEY))
    assert listed.status_code == 200
    assert [e["engine_id"] for e in listed.json()["decode"]] == ["decode-0"]

    extra = await make_engine("decode-9")
    body = {"role": "decode", "engine_id": "decode-9", "url": extra.url, "kv_endpoints": ["tcp://127.0.0.1:5709"]}
    added = await admin.post("/admin/engines", headers=key, json=body)
    assert added.status_code == 201, added.text
    assert [(e["engine_id"], e["kv_endpoints"]) for e in added.json()["decode"]] == [
        ("decode-0", []),
        ("decode-9", ["tcp://127.0.0.1:5709"]),
    ]
    served = {(await admin.post(CHAT_PATH, json=CHAT, headers=bearer(KEY))).headers["x-pdserve-decode"] for _ in "ab"}
    assert served == {"decode-0", "decode-9"}

    drained = await admin.post("/admin/engines/decode-0/drain", headers=key)
    assert drained.status_code == 200
    assert (await admin.post(CHAT_PATH, json=CHAT, headers=bearer(KEY))).headers["x-pdserve-decode"] == "decode-9"

    removed = await admin.delete("/admin/engines/decode-9", headers=key)
    assert removed.status_code == 200
    assert [(e["engine_id"], e["draining"]) for e in removed.json()["decode"]] == [("decode-0", True)]
    # No decode engine takes requests now: a prefill engine serves them whole (proxy.degrade).
    degraded = await admin.post(CHAT_PATH, json=CHAT, headers=bearer(KEY))
    assert degraded.headers["x-pdserve-path"] == "prefill-only; reason=no-decode-engine"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"role": "encode", "engine_id": "x", "url": "http://127.0.0.1:1"}, "role"),
        ({"role": "decode", "engine_id": "", "url": "http://127.0.0.1:1"}, "engine_id"),
        ({"role": "decode", "engine_id": "x", "url": "ftp://host"}, "url"),
        (
            {"role": "decode", "engine_id": "x", "url": "http://h:1", "kv_endpoints": ["http://h:5700"]},
            "kv_endpoints.0",
        ),
        ({"role": "decode", "engine_id": "decode-0", "url": "http://127.0.0.1:1"}, None),  # already in the pool
    ],
)
async def test_admin_refuses_a_bad_engine(admin, body, param):
    response = await admin.post("/admin/engines", headers={"X-Admin-Key": ADMIN_KEY}, json=body)

    assert_openai_error(response, 400, error_type="invalid_request_error", param=param)


async def test_admin_unknown_engine_is_404(admin):
    response = await admin.delete("/admin/engines/nobody", headers={"X-Admin-Key": ADMIN_KEY})

    assert_openai_error(response, 404, error_type="invalid_request_error", code="engine_not_found", param="engine_id")


# --- where an admin may add engines ---------------------------------------------------------------


async def test_admin_may_add_an_engine_only_on_the_clusters_hosts(admin, pool):
    key = {"X-Admin-Key": ADMIN_KEY}
    foreign = {"role": "decode", "engine_id": "decode-9", "url": "http://203.0.113.7:8100"}
    refused = await admin.post("/admin/engines", headers=key, json=foreign)
    error = assert_openai_error(refused, 400, error_type="invalid_request_error", param="url")
    assert "203.0.113.7 is not a host of this cluster's engines (127.0.0.1)" in error["message"]

    side_channel_elsewhere = {**foreign, "url": "http://127.0.0.1:8109", "kv_endpoints": ["tcp://203.0.113.7:5709"]}
    refused = await admin.post("/admin/engines", headers=key, json=side_channel_elsewhere)
    assert_openai_error(refused, 400, error_type="invalid_request_error", param="kv_endpoints.0")

    assert [e.engine_id for e in pool.engines()] == ["prefill-0", "decode-0"]  # nothing was added
    assert pool.cluster_hosts == {"127.0.0.1"}  # what the pool was given, never what an admin adds


async def test_admin_engine_networks_allow_addresses_not_names(make_client, pool):
    admin = await make_client(admin_key_env=("PD_ADMIN_KEY",), admin_engine_networks=("203.0.113.0/24",))
    key = {"X-Admin-Key": ADMIN_KEY}
    in_network = {"role": "decode", "engine_id": "decode-9", "url": "http://203.0.113.7:8100"}
    added = await admin.post("/admin/engines", headers=key, json=in_network)
    assert added.status_code == 201, added.text
    by_name = {"role": "decode", "engine_id": "decode-10", "url": "http://engines.example:8100"}
    refused = await admin.post("/admin/engines", headers=key, json=by_name)
    assert_openai_error(refused, 400, error_type="invalid_request_error", param="url")
    assert "203.0.113.7" not in pool.cluster_hosts


def test_a_bad_admin_engine_network_names_itself() -> None:
    with pytest.raises(ProxyConfigError, match="admin_engine_networks: '10.0.0.0/33' is not a network"):
        create_app(ProxyConfig(model_name="m", admin_engine_networks=("10.0.0.0/33",)))
