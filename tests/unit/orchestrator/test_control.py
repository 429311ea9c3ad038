"""The controller's HTTP API (``orchestrator.control``, ``orchestrator.control_server``): a real server on
loopback in front of a fake controller, called by the CLI's real client."""

from __future__ import annotations

import asyncio
import json
import stat
import urllib.request
from typing import Any

import pytest

from orchestrator.control import (
    STATUS_SCHEMA,
    ControlClient,
    ControlError,
    new_token,
    token_digest,
    token_matches,
)
from orchestrator.control_server import ControlServer
from orchestrator.errors import ClusterNotRunning
from orchestrator.state import ClusterState
from tests.status_schema import schema_problems


def status_document() -> dict[str, Any]:
    engine = {
        "engine_id": "prefill-0",
        "model": "smollm2-135m-instruct",
        "role": "prefill",
        "state": "ready",
        "url": "http://127.0.0.1:8100",
        "host": "127.0.0.1",
        "kv_endpoints": ["tcp://127.0.0.1:5600"],
        "pid": 1234,
        "cpu_bind": "0",
        "load_s": 31.5,
        "phases": [{"phase": "weights loaded", "s": 12.0}, {"phase": "ready", "s": 31.5}],
        "restarts": 0,
        "failures": 0,
        "error": None,
        "log_path": "/tmp/logs/prefill-0.log",
        "kept_warm": False,
        "moving_from": None,
        "kv_quarantined_blocks": 0,
    }
    return {
        "schema": STATUS_SCHEMA,
        "name": "demo",
        "model": "smollm2-135m-instruct",
        "connector": "pdserve",
        "phase": "ready",
        "error": None,
        "proxy_url": "http://127.0.0.1:8000",
        "started_at": 1.0,
        "ready_s": 40.2,
        "log_dir": "/tmp/logs",
        "controller": {"pid": 99, "restarts": 0, "api_url": "http://127.0.0.1:1"},
        "pools": {"prefill": {"target": 1, "max": 1, "ready": 1, "moving": 0, "draining": 0}},
        "models": [
            {
                "name": "smollm2-135m-instruct",
                "key": "",
                "pools": {"prefill": {"target": 1, "max": 1, "ready": 1, "moving": 0, "draining": 0}},
                "autoscaler": None,
            }
        ],
        "engines": [engine],
        "hosts": [{"ip": "127.0.0.1", "alive": True, "head": True, "labels": {}, "engines": ["prefill-0"]}],
        "autoscaler": None,
        "moves": [],
        "events": [{"t": 1.0, "message": "cluster ready"}],
    }


class FakeController:
    def __init__(self) -> None:
        self.scaled: list[tuple[dict[str, int], str]] = []
        self.shut_down = 0

    async def status(self) -> dict[str, Any]:
        return status_document()

    async def scale(self, targets: dict[str, int], reason: str = "by hand", model: str | None = None) -> dict[str, Any]:
        self.scaled.append((targets, reason))
        if targets.get("prefill", 0) > 4:
            return {"error": f"prefill={targets['prefill']} is outside 1..4 (the pool's bounds in the spec)"}
        return {"plan": {}, "targets": targets}

    async def shutdown(self) -> None:
        self.shut_down += 1


@pytest.fixture
async def api() -> Any:
    token = new_token()
    controller = FakeController()
    exited = asyncio.Event()

    async def after_shutdown() -> None:
        exited.set()

    server = ControlServer(controller, token_digest(token), "127.0.0.1", after_shutdown=after_shutdown)
    url = await server.start()
    yield url, token, controller, exited
    await server.stop()


def raw_get(url: str, headers: dict[str, str]) -> tuple[int, dict]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}, {"Authorization": "Bearer "}],
    ids=["none", "wrong-token", "other-scheme", "empty"],
)
async def test_every_route_refuses_a_caller_without_the_token(api, headers):
    url, _, controller, _ = api
    status, body = await asyncio.to_thread(raw_get, url + "/v1/status", headers)
    assert status == 401
    assert body["error"]["type"] == "unauthorized" and "token" in body["error"]["message"]
    with pytest.raises(ControlError, match="refused POST /v1/shutdown"):
        await asyncio.to_thread(ControlClient(url, "not-the-token").shutdown)
    assert controller.shut_down == 0


async def test_health_answers_without_a_token_and_says_nothing_else(api):
    url, *_ = api
    assert await asyncio.to_thread(raw_get, url + "/health", {}) == (200, {"ok": True})


async def test_status_through_the_client_is_the_documented_schema(api):
    url, token, *_ = api
    status = await asyncio.to_thread(ControlClient(url, token).status)
    assert status["schema"] == STATUS_SCHEMA
    assert schema_problems(status) == []


def test_schema_problems_name_the_field_and_the_type():
    status = status_document()
    del status["pools"]
    status["engines"][0]["restarts"] = "2"
    status["ready_s"] = True
    status["hosts"][0]["alive"] = "yes"
    assert schema_problems(status) == [
        "ready_s is bool, expected float/int/NoneType",
        "pools is missing",
        "engines.0.restarts is str, expected int",
        "hosts.0.alive is str, expected bool",
    ]


async def test_scale_passes_targets_and_a_refusal_comes_back_in_the_controllers_words(api):
    url, token, controller, _ = api
    client = ControlClient(url, token)
    assert (await asyncio.to_thread(client.scale, {"prefill": 2}))["targets"] == {"prefill": 2}
    with pytest.raises(ControlError, match=r"prefill=9 is outside 1\.\.4"):
        await asyncio.to_thread(client.scale, {"prefill": 9})
    assert controller.scaled == [({"prefill": 2}, "by hand"), ({"prefill": 9}, "by hand")]


@pytest.mark.parametrize("body", [{}, {"targets": {"prefill": "2"}}, {"targets": {"prefill": True}}, {"targets": [1]}])
async def test_a_malformed_scale_request_is_a_400(api, body):
    url, token, controller, _ = api

    def post() -> int:
        request = urllib.request.Request(
            url + "/v1/scale",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Authorization": f"Bearer {token}"},
        )
        try:
            urllib.request.urlopen(request, timeout=10)
        except urllib.error.HTTPError as e:
            assert "targets" in json.loads(e.read())["error"]["message"]
            return e.code
        return 200

    assert await asyncio.to_thread(post) == 400
    assert controller.scaled == []


async def test_shutdown_answers_first_and_then_lets_the_controller_exit(api):
    url, token, controller, exited = api
    assert await asyncio.to_thread(ControlClient(url, token).shutdown) == {"stopped": True}
    assert controller.shut_down == 1
    await asyncio.wait_for(exited.wait(), timeout=5)


def test_a_controller_that_does_not_answer_is_a_cluster_not_running():
    with pytest.raises(ClusterNotRunning, match="does not answer"):
        ControlClient("http://127.0.0.1:9", "token", timeout_s=2).status()  # port 9: discard, nothing listens


def test_token_digest_and_match():
    token = new_token()
    assert len(token) >= 40 and token != new_token()
    assert token_matches(f"Bearer {token}", token_digest(token))
    assert token_matches(f"bearer {token}", token_digest(token))
    assert not token_matches(f"Bearer {token}x", token_digest(token))
    assert not token_matches(None, token_digest(token))
    with pytest.raises(ValueError, match="token digest"):
        ControlServer(FakeController(), "", "127.0.0.1")


def test_the_state_file_holding_the_token_is_readable_by_its_owner_only(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_STATE_DIR", str(tmp_path))
    state = ClusterState("c", "pdserve", "c.yaml", "127.0.0.1:1", True, None, "/tmp", "http://x", "http://y", "secret")
    state.save()
    assert stat.S_IMODE(ClusterState.path().stat().st_mode) == 0o600
    assert ClusterState.load().api_token == "secret"
    state.save()  # again, over the old one
    assert stat.S_IMODE(ClusterState.path().stat().st_mode) == 0o600
