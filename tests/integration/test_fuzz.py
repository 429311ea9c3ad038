"""Our own fuzz suite against the shared cluster of our connector (real engines, real NIXL, real HTTP and TCP).

What anyone on the network can send an engine is thrown at it: every route of the engine's real route table
without the key, transfer parameters of every wrong type through every route a client (the proxy) or a peer
(an engine's own HTTP routes, with the key) reaches, and random, empty, oversized, wrong-magic, half-sent,
replayed and cross-engine messages at the side channels. Each test ends where a user would look: both engines alive with
the same process ids, their side channels answering, and the next request's KV moved over the wire
(``X-PDServe-KV: source=transfer``).
"""

from __future__ import annotations

import json
import random
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from connectors.side_client import ping
from contract import wire
from contract.auth import KVAuth, read_secret_file
from contract.framing import frame
from tests.integration.conftest import Cluster, http_json, kv_report, metric_values
from tests.unit.connectors.side_channel_peers import dropped_unanswered, exchange, header

pytestmark = [pytest.mark.integration, pytest.mark.parametrize("cluster", ["pdserve"], indirect=True)]

MODEL = "smollm2-135m-instruct"
OPEN = {"/health", "/metrics"}
# Beside the table's routes: FastAPI's own pages, and paths a later vLLM might add or a prober might try.
EXTRA_PATHS = ["/docs", "/redoc", "/openapi.json", "/a-route-vllm-adds-in-2027", "/metrics", "/metrics/x", "/health/",
               "//v1/models"]  # fmt: skip
BAD_PARAMS = [
    {"do_remote_prefill": True, "remote_block_ids": 5},
    {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r", "remote_host": "127.0.0.1",
     "remote_port": "15600", "remote_block_ids": [1]},
    {"do_remote_prefill": True, "remote_engine_id": ["p"], "remote_request_id": {}, "remote_host": 7,
     "remote_port": 15600, "remote_block_ids": [[1], [2]]},
    {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r", "remote_host": "127.0.0.1",
     "remote_port": 15600, "remote_block_ids": list(range(5000)), "tp_size": 10**12, "block_size": -1},
    {"do_remote_decode": "yes", "pdserve_reader": {"x": 1}},
]  # fmt: skip


def chat(prompt: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0, **extra}


def kv_auth(cluster: Cluster) -> KVAuth:
    return KVAuth(read_secret_file(Path(cluster.env["PDSERVE_STATE_DIR"]) / "cluster-secret"))


def call(method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> int:
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def pids(cluster: Cluster) -> dict[str, int]:
    return {e["engine_id"]: e["pid"] for e in cluster.refresh()["engines"]}


def assert_cluster_whole(cluster: Cluster, pids_before: dict[str, int]) -> None:
    """Both engines alive as before (same processes: none died and was restarted), healthy, their side
    channels answering, and the next request's KV moved over the wire."""
    time.sleep(2)  # an engine core that died is noticed within a second (the actor's watchdog)
    assert pids(cluster) == pids_before
    auth = kv_auth(cluster)
    for engine in cluster.status["engines"]:
        assert call("GET", engine["url"] + "/health") == 200, engine["engine_id"]
        for endpoint in engine["kv_endpoints"]:
            assert ping(endpoint, auth, 10.0), endpoint
    status, headers, answer = http_json(cluster.proxy_url + "/v1/chat/completions", chat("Hi!", max_tokens=4))
    assert status == 200, answer
    assert kv_report(headers)["source"] == "transfer", headers


def test_every_engine_route_but_the_probes_needs_the_engine_key(cluster: Cluster) -> None:
    before = pids(cluster)
    for role in ("prefill", "decode"):
        url = cluster.engine(role)["url"]
        assert call("GET", url + "/openapi.json") == 401  # the route table itself is the cluster's
        with urllib.request.urlopen(
            urllib.request.Request(url + "/openapi.json", headers=cluster.engine_headers), timeout=30
        ) as response:
            table = json.loads(response.read())["paths"]
        assert "/invocations" in table and "/v1/completions" in table  # the real table, as vLLM serves it
        routes = [(method.upper(), re.sub(r"\{[^}]*\}", "x", path)) for path, item in table.items() for method in item]
        routes += [(method, path) for path in EXTRA_PATHS for method in ("GET", "POST")]
        answered = {
            (method, path): call(method, url + path, b"{}" if method in ("POST", "PUT", "PATCH") else None)
            for method, path in routes
        }
        opened = {route: status for route, status in answered.items() if route[1] not in OPEN and status != 401}
        assert opened == {}, f"{role}: answered without the engine key: {opened}"
        assert answered["GET", "/health"] == 200 and answered["GET", "/metrics"] == 200  # the probes stay open
        assert len(table) >= 10, sorted(table)  # the whole table was asked, not a few paths
    assert_cluster_whole(cluster, before)


def test_transfer_params_of_every_wrong_type_through_every_route_never_hurt_an_engine(cluster: Cluster) -> None:
    before = pids(cluster)
    decode_url = cluster.engine("decode")["url"]
    refused_before = metric_values(decode_url, "pdserve:kv_refused_total", "kind").get("malformed_params", 0)
    # A client, through the proxy: every field vLLM maps onto the connector's input is refused, 400.
    for path, body in [("/v1/chat/completions", chat("Hi", max_tokens=2)),
                       ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})]:  # fmt: skip
        for params in BAD_PARAMS:
            for smuggled in ({"kv_transfer_params": params}, {"vllm_xargs": {"kv_transfer_params": params}}):
                status, _, error = http_json(cluster.proxy_url + path, body | smuggled)
                assert status == 400 and "never by a client" in error["error"]["message"], error
    # A peer with the engine key (what a compromised proxy could send), on each inference route of the engine:
    # the connector refuses what it cannot use and the prompt is computed locally.
    served = 0
    for path, body in [("/v1/chat/completions", chat("Hi", max_tokens=2)),
                       ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
                       ("/invocations", chat("Hi", max_tokens=2))]:  # fmt: skip
        for params in BAD_PARAMS[:4]:
            status, headers, answer = http_json(
                decode_url + path, body | {"kv_transfer_params": params}, headers=cluster.engine_headers
            )
            assert status == 200, (path, params, answer)
            assert answer["kv_transfer_params"]["pdserve_kv"]["reason"] == "malformed", answer
            served += 1
        # vllm_xargs may carry a value that is not even an object: no P/D, and the engine lives
        status, _, answer = http_json(
            decode_url + path, body | {"vllm_xargs": {"kv_transfer_params": 7}}, headers=cluster.engine_headers
        )
        assert status in (200, 400, 500), answer
    # and the prefill side: a request to keep KV with a reader of the wrong type is offered to any reader
    status, _, answer = http_json(
        cluster.engine("prefill")["url"] + "/v1/chat/completions",
        chat("Hi", max_tokens=1, kv_transfer_params={"do_remote_decode": True, "pdserve_reader": {"x": 1}}),
        headers=cluster.engine_headers,
    )
    assert status == 200 and wire.PDSERVE_READER not in answer["kv_transfer_params"], answer
    http_json(cluster.proxy_url + "/v1/chat/completions", chat("Hello", max_tokens=2))  # a step publishes the count

    def refused() -> float:
        return metric_values(decode_url, "pdserve:kv_refused_total", "kind").get("malformed_params", 0) - refused_before

    deadline = time.monotonic() + 20
    while refused() != served and time.monotonic() < deadline:
        time.sleep(0.5)
    assert refused() == served
    assert_cluster_whole(cluster, before)


def raw(endpoint: str, message: bytes, timeout_ms: int = 5000) -> bytes | None:
    """Send ``message`` framed, on a fresh connection (as any host could); the answer, or None."""
    return exchange(endpoint, frame(message), timeout_ms)


def test_side_channels_outlive_random_empty_huge_unframed_replayed_and_cross_engine_messages(cluster: Cluster) -> None:
    before = pids(cluster)
    auth = kv_auth(cluster)
    prefill, decode = cluster.engine("prefill"), cluster.engine("decode")
    rng = random.Random(29)
    for engine in (prefill, decode):
        endpoint = engine["kv_endpoints"][0]
        for _ in range(150):
            message = rng.randbytes(rng.choice([1, 7, 64, 4096]))
            answer = raw(endpoint, message)
            assert answer is not None and answer.startswith(b"ERR "), (message[:16], answer)
        # what the channel does not take is dropped at its header, unanswered and unread
        assert dropped_unanswered(endpoint, header(0))  # an empty message
        assert dropped_unanswered(endpoint, header(8 << 20) + bytes(1 << 20))  # over the limit
        assert dropped_unanswered(endpoint, b"PDS1 release 9999999999999 " + b"0" * 64 + b" " + b"x" * (4 << 20))
        assert dropped_unanswered(endpoint, header(100) + b"x" * 10, half_close=True)  # half a message
        sealed_ping = auth.seal(b"ping", b"")
        assert raw(endpoint, sealed_ping) == b"OK" and raw(endpoint, sealed_ping) == b"OK"  # a replay
        # what another engine's side channel would answer is no request here
        assert raw(endpoint, auth.seal(b"handshake-reply", b"nonce payload")).startswith(b"ERR ")
        assert raw(endpoint, auth.seal(b"handshake", b"nonce junk")).startswith(b"ERR malformed")
        assert raw(endpoint, auth.seal(b"report", b"prefill-0 no-such-request")) == b"NONE"
        assert raw(endpoint, auth.seal(b"release", b"no-such-request")) == b"OK"  # nothing to free
    assert_cluster_whole(cluster, before)


def test_a_release_replayed_changes_nothing(cluster: Cluster) -> None:
    """A prefill's sealed release, sent again and again (as anyone who saw it on the wire could): the first
    ends the lease, the rest find none, and the engine goes on serving."""
    before = pids(cluster)
    prefill = cluster.engine("prefill")
    status, _, issued = http_json(
        prefill["url"] + "/v1/chat/completions",
        chat("Name a color.", max_tokens=1, kv_transfer_params=dict(wire.PREFILL_REQUEST_PARAMS)),
        headers=cluster.engine_headers,
    )
    assert status == 200
    release = issued["kv_transfer_params"][wire.PDSERVE_RELEASE]["message"].encode()
    for _ in range(3):
        assert raw(prefill["kv_endpoints"][0], release) == b"OK"
    assert_cluster_whole(cluster, before)
