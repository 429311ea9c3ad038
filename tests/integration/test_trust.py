"""Who may talk to the cluster's engines, on the shared cluster of our connector (real engines, real NIXL).

- Engines' ``/v1`` routes answer only the cluster's engine key (the proxy's); ``/health`` stays open.
- A decode engine acts only on transfer parameters a prefill engine of this cluster issued, for it, once,
  before they expire: forged, altered, expired, replayed or someone else's parameters make it compute
  the prompt itself (same greedy answer), and it never connects to the peer they name.
- A side channel answers nobody without the secret: raw handshakes, releases and report queries
  are refused, counted in ``pdserve:kv_refused_total``, and change nothing.
- SIGKILL of the only prefill engine under load (8 clients): no request fails beyond those in flight at
  the kill; the rest are served decode-only, and disaggregated serving returns with the engine.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from connectors.handshake import HandshakeRequest, encode_request
from connectors.side_messages import MAX_REQUEST_BYTES
from contract import wire
from contract.auth import KVAuth, read_secret_file
from contract.framing import FramingError, recv_frame
from tests.integration.clients import CLIENT_MIX, answers_equal, kill_outcome, kill_under_load, mixed_send
from tests.integration.conftest import Cluster, http_json, kv_report, metric_values
from tests.unit.connectors.side_channel_peers import ask

pytestmark = [pytest.mark.integration, pytest.mark.parametrize("cluster", ["pdserve"], indirect=True)]

MODEL = "smollm2-135m-instruct"
REFUSED = "pdserve:kv_refused_total"
SOURCE_METRIC = "vllm:prompt_tokens_by_source_total"
LEASES = "pdserve:kv_leases_total"


def chat(prompt: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0, **extra}


def kv_auth(cluster: Cluster) -> KVAuth:
    """The cluster's KV key: the test plays a prefill engine of the cluster where it needs valid MACs."""
    return KVAuth(read_secret_file(Path(cluster.env["PDSERVE_STATE_DIR"]) / "cluster-secret"))


def eventually(read, expected, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while (value := read()) != expected and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


def test_engines_answer_only_the_clusters_engine_key(cluster: Cluster) -> None:
    for role in ("prefill", "decode"):
        url = cluster.engine(role)["url"]
        status, _, body = http_json(url + "/v1/chat/completions", chat("Hi", max_tokens=2))
        assert status == 401, body
        status, _, body = http_json(
            url + "/v1/chat/completions", chat("Hi", max_tokens=2), headers={"Authorization": "Bearer guess"}
        )
        assert status == 401, body
        with urllib.request.urlopen(url + "/health", timeout=10) as response:  # open: the controller probes it
            assert response.status == 200
    # The proxy holds the key: the same request through it is served.
    status, _, body = http_json(cluster.proxy_url + "/v1/chat/completions", chat("Hi", max_tokens=2))
    assert status == 200, body


class ForgedPeer:
    """A TCP listener where forged parameters send the decode engine: it records any connection (the
    side channel's port and the next, as for a TP rank)."""

    def __init__(self) -> None:
        self.sockets = []
        for _ in range(20):
            first = socket.socket()
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            second = socket.socket()
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                first.close()
                second.close()
                continue
            self.sockets = [first, second]
            break
        self.port = port
        for sock in self.sockets:
            sock.listen(8)
            sock.setblocking(False)

    def connections(self) -> int:
        count = 0
        for sock in self.sockets:
            while True:
                try:
                    conn, _ = sock.accept()
                except BlockingIOError:
                    break
                conn.close()
                count += 1
        return count

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def issued_params(cluster: Cluster, prompt: str, reader: str = "decode-0") -> dict:
    """Real parameters: the prefill engine computes ``prompt`` for ``reader``, as the proxy has it do."""
    body = chat(prompt, max_tokens=1)
    body[wire.KV_TRANSFER_PARAMS] = dict(wire.PREFILL_REQUEST_PARAMS, **{wire.PDSERVE_READER: reader})
    status, _, answer = http_json(
        cluster.engine("prefill")["url"] + "/v1/chat/completions", body, headers=cluster.engine_headers
    )
    assert status == 200, answer
    params = answer[wire.KV_TRANSFER_PARAMS]
    assert params[wire.PDSERVE_MAC] and params[wire.PDSERVE_READER] == reader
    return params


def decode_with(cluster: Cluster, prompt: str, params: dict) -> dict:
    body = chat(prompt, max_tokens=12) | {wire.KV_TRANSFER_PARAMS: params}
    status, _, answer = http_json(
        cluster.engine("decode")["url"] + "/v1/chat/completions", body, headers=cluster.engine_headers
    )
    assert status == 200, answer
    return answer


def test_transfer_parameters_not_issued_for_this_read_are_refused_and_the_prompt_computed(cluster: Cluster) -> None:
    decode_url = cluster.engine("decode")["url"]
    prompt = "Name a large animal that lives in the sea."
    status, _, alone = http_json(
        decode_url + "/v1/chat/completions", chat(prompt, max_tokens=12), headers=cluster.engine_headers
    )
    assert status == 200, alone
    expected = alone["choices"][0]["message"]["content"]
    auth, peer = kv_auth(cluster), ForgedPeer()
    try:
        genuine = issued_params(cluster, prompt)
        at_peer = {**genuine, wire.REMOTE_HOST: "127.0.0.1", wire.REMOTE_PORT: peer.port}
        forged = {
            "no MAC": {k: v for k, v in at_peer.items() if k != wire.PDSERVE_MAC},
            "wrong MAC (a foreign host put in)": at_peer,
            "another cluster's MAC": {**at_peer, wire.PDSERVE_MAC: "ab" * 32},
            "expired": auth.sign_params(dict(at_peer), ttl_s=-5),
            "for another decode engine": auth.sign_params({**at_peer, wire.PDSERVE_READER: "decode-9"}, ttl_s=60),
        }
        refused_before = metric_values(decode_url, REFUSED, "kind").get("params", 0)
        for case, params in forged.items():
            answer = decode_with(cluster, prompt, params)
            assert answer["choices"][0]["message"]["content"] == expected, case
            assert answer[wire.KV_TRANSFER_PARAMS][wire.PDSERVE_KV] == {
                "source": "recomputed",
                "reason": "expired" if case == "expired" else "unauthenticated",
            }, case
        # The genuine ones, once: read over NIXL; a replay of them: refused (their blocks are gone by now).
        first = decode_with(cluster, prompt, genuine)
        assert first[wire.KV_TRANSFER_PARAMS][wire.PDSERVE_KV]["source"] == "transfer"
        replay = decode_with(cluster, prompt, genuine)
        assert replay[wire.KV_TRANSFER_PARAMS][wire.PDSERVE_KV]["reason"] == "unauthenticated"
        assert first["choices"][0]["message"]["content"] == replay["choices"][0]["message"]["content"] == expected
        time.sleep(1.0)
        assert peer.connections() == 0  # the decode engine never went where the forged parameters said
        refused = lambda: metric_values(decode_url, REFUSED, "kind").get("params", 0) - refused_before  # noqa: E731
        assert eventually(refused, len(forged) + 1) == len(forged) + 1
    finally:
        peer.close()


def test_a_handshake_that_times_out_is_recomputed_within_the_timeout(cluster: Cluster) -> None:
    """Valid parameters (the test signs them as a prefill of the cluster would) naming a side channel that
    never answers: the decode engine gives up after ``handshake_timeout_s`` (5 s) and computes the prompt.

    The parameters name an engine the decode engine has not met: it keeps one connection per remote
    engine rank, and a known engine's blocks would be read over it whatever address they named."""
    silent = socket.create_server(("127.0.0.1", 0))  # takes the handshake, never answers
    silent.settimeout(60)
    port = silent.getsockname()[1]
    arrived = threading.Event()
    held: list[socket.socket] = []

    def take_the_handshake() -> None:
        try:
            held.append(silent.accept()[0])
            if recv_frame(held[0], MAX_REQUEST_BYTES, time.monotonic() + 60):
                arrived.set()
        except (OSError, FramingError):
            pass

    listener = threading.Thread(target=take_the_handshake, daemon=True)
    listener.start()
    prompt = "Name a planet of the solar system."
    try:
        issued = issued_params(cluster, prompt)
        elsewhere = {wire.REMOTE_ENGINE_ID: "prefill-silent", wire.REMOTE_HOST: "127.0.0.1", wire.REMOTE_PORT: port}
        params = kv_auth(cluster).sign_params({**issued, **elsewhere}, 60)
        started = time.monotonic()
        answer = decode_with(cluster, prompt, params)
        elapsed = time.monotonic() - started
        report = answer[wire.KV_TRANSFER_PARAMS][wire.PDSERVE_KV]
        assert report["source"] == "recomputed" and report["reason"] == "unreachable", report
        assert elapsed < 5 + 30, elapsed  # the handshake timeout, then a short CPU prefill
        assert arrived.is_set()  # the handshake did arrive: the timeout, not a refusal, decided
    finally:
        listener.join(timeout=65)
        silent.close()
        for sock in held:
            sock.close()
    # The lease the real prefill holds for the unread blocks ends with the cluster's own release.
    assert ask(cluster.engine("prefill")["kv_endpoints"][0], issued[wire.PDSERVE_RELEASE]["message"].encode()) == b"OK"


def wait_restarted(cluster: Cluster, role: str, old_pid: int) -> None:
    """Ray restarts the killed actor and the controller starts vLLM in it again (each `pdserve status` may be
    slow here: see CLI_TIMEOUT_S)."""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        engine = cluster.refresh() and cluster.engine(role)
        if engine["state"] == "ready" and engine["pid"] != old_pid:
            return
        time.sleep(2)
    raise AssertionError(f"the {role} engine did not come back: {engine}")


def test_a_decode_engine_that_cannot_be_reached_is_replaced_and_the_kv_bound_to_it_released(cluster: Cluster) -> None:
    """The proxy's pool gets a decode engine that is gone (its port refuses, as a dead engine's does) beside
    decode-0: the requests round robin sends there are served by decode-0 instead, whole (the prefill's
    KV was bound to the gone engine and is released at once, not at its lease's end), same answer."""
    status = cluster.refresh()
    decode, prefill_url = cluster.engine("decode"), cluster.engine("prefill")["url"]
    serving = [(decode["engine_id"], decode["url"], tuple(decode["kv_endpoints"]))]
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        gone_port = closed.getsockname()[1]
    gone = ("decode-9", f"http://127.0.0.1:{gone_port}", (f"tcp://127.0.0.1:{gone_port}",))
    prompt = chat("Name three rivers of Europe.", max_tokens=12)
    code, _, body = http_json(cluster.proxy_url + "/v1/chat/completions", prompt)
    assert code == 200, body
    expected = body["choices"][0]["message"]["content"]

    released_before = metric_values(prefill_url, LEASES, "outcome").get("released", 0.0)
    set_decode_pool(cluster, status["name"], [*serving, gone])
    try:
        answers = [http_json(cluster.proxy_url + "/v1/chat/completions", prompt) for _ in range(4)]
    finally:
        set_decode_pool(cluster, status["name"], serving)
    for code, _, body in answers:
        assert code == 200, body
        assert body["choices"][0]["message"]["content"] == expected
    paths = [{k.lower(): v for k, v in headers.items()}["x-pdserve-path"] for _, headers, _ in answers]
    failed_over = paths.count("decode-only; reason=decode-failed")
    assert failed_over >= 1, paths  # round robin sent some to decode-9
    # Released, not left to expire with the lease (60 s): the prefill engine counts each one at once.
    released = eventually(
        lambda: metric_values(prefill_url, LEASES, "outcome").get("released", 0.0) - released_before, failed_over, 10
    )
    assert released == failed_over


def set_decode_pool(cluster: Cluster, name: str, endpoints: list[tuple]) -> None:
    """Make ``endpoints`` the proxy's decode pool, as the controller does, from a Ray driver of its own
    (Ray reads its auth mode once per process: this one may have imported Ray already)."""
    script = (
        "import json, sys\n"
        "from orchestrator.state import ClusterState\nfrom orchestrator.ray_head import ray_connection\n"
        "with ray_connection(ClusterState.load()) as ray:\n"
        "    proxy = ray.get_actor(sys.argv[1] + '-proxy')\n"
        "    pool = [(engine, url, tuple(kv)) for engine, url, kv in json.loads(sys.argv[2])]\n"
        "    ray.get(proxy.set_endpoints.remote('decode', pool))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, name, json.dumps(endpoints)], env=cluster.env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_side_channel_refuses_and_counts_a_client_without_the_secret(cluster: Cluster) -> None:
    prefill = cluster.engine("prefill")
    prefill_url, endpoint = prefill["url"], prefill["kv_endpoints"][0]
    before = metric_values(prefill_url, REFUSED, "kind")
    leases_before = metric_values(prefill_url, "pdserve:kv_leases_total", "outcome").get("released", 0)
    params = issued_params(cluster, "What colour is the sky?")  # a lease the intruder tries to end
    from tests.unit.kv_factories import topology_factory

    messages = {
        "handshake": encode_request(HandshakeRequest(engine_id="intruder", topology=topology_factory()())),
        "release": b"PDRL " + params[wire.REMOTE_REQUEST_ID].encode(),
        "report": b"PDKV prefill-0 " + params[wire.REMOTE_REQUEST_ID].encode(),
    }
    for message in messages.values():
        assert ask(endpoint, message).startswith(b"ERR unauthenticated")
    # Sealed, but with a key of its own:
    stranger = KVAuth(read_secret_file(_write_other_secret(cluster)))
    assert ask(endpoint, stranger.seal(b"release", params[wire.REMOTE_REQUEST_ID].encode())).startswith(
        b"ERR unauthenticated wrong MAC"
    )
    # The engine counts at its next step; one request through the proxy makes one.
    status, _, _ = http_json(cluster.proxy_url + "/v1/chat/completions", chat("Hello", max_tokens=2))
    assert status == 200

    def refused() -> dict:
        after = metric_values(prefill_url, REFUSED, "kind")
        return {k: after.get(k, 0) - before.get(k, 0) for k in ("message", "release")}

    assert eventually(refused, {"message": 3, "release": 1}) == {"message": 3, "release": 1}
    released = metric_values(prefill_url, "pdserve:kv_leases_total", "outcome").get("released", 0)
    assert released == leases_before  # nothing the intruder sent ended the lease
    # The cluster's own release (the proxy's, from the parameters) still does.
    assert ask(endpoint, params[wire.PDSERVE_RELEASE]["message"].encode()) == b"OK"


def _write_other_secret(cluster: Cluster) -> Path:
    from contract.auth import new_secret, write_secret

    path = Path(cluster.env["PDSERVE_STATE_DIR"]) / "another-clusters-secret"
    write_secret(path, new_secret())
    return path


def test_killing_the_only_prefill_engine_under_load_fails_only_what_was_in_flight(cluster: Cluster) -> None:
    cluster.refresh()
    prefill = cluster.engine("prefill")

    def send(n: int, i: int) -> tuple[int, str]:  # (status, X-PDServe-Path)
        try:
            status, headers, _ = http_json(
                cluster.proxy_url + "/v1/chat/completions",
                chat(f"Client {n}, question {i}: name a fruit.", max_tokens=4),
                timeout=300,
            )
        except OSError as e:  # the proxy itself failed the client: counted as a failure
            status, headers = 0, {"x-pdserve-path": f"no answer: {e}"}
        return status, path_of(headers)

    results, kill = kill_under_load(prefill["pid"], 8, send, lambda r: r[3] == "disaggregated")

    in_flight = [r for r in results if r[0] < kill < r[1]]
    failed = [r for r in results if r[2] != 200]
    after = [r for r in results if r[0] > kill]
    print(
        f"kill under load: {len(results)} requests, {len(in_flight)} in flight at the kill, {len(failed)} failed, "
        f"{len(after)} sent after it: {sorted({r[3] for r in after})}"
    )
    assert all(r[0] < kill < r[1] for r in failed), failed  # nothing sent after the kill failed
    assert len(after) >= 8 and all(r[2] == 200 for r in after)
    assert all(r[3].startswith("decode-only") for r in after if r[0] > kill + 2), after
    # Ray restarts the actor, the controller starts vLLM in it again: disaggregated serving returns.
    wait_restarted(cluster, "prefill", prefill["pid"])
    deadline = time.monotonic() + 60  # the proxy hears of it at the controller's next probe
    while True:
        status, headers, _ = http_json(cluster.proxy_url + "/v1/chat/completions", chat("Name a colour.", max_tokens=4))
        if path_of(headers) == "disaggregated" or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert status == 200 and path_of(headers) == "disaggregated"
    # The restarted engine is a new start (epoch) under the same id and port: the decode engine handshakes with
    # it again before its first READ, never reading through the old start's mapping (which failed, recomputed).
    assert kv_report(headers)["source"] == "transfer", kv_report(headers)


def test_killing_the_only_decode_engine_under_load_fails_none_of_its_requests(cluster: Cluster) -> None:
    """kill -9 of the decode engine under greedy load, streamed (chat and completions) and not, and a seeded
    request not streamed: each request it had goes to the prefill engine (``decode_retries``, ``degrade``), a
    non-streamed one computed again, a stream continued from the tokens already sent (``proxy.continuation``) as
    one unbroken stream; every answer is the one the decode engine gives once it is back, text and usage. A
    sampled stream it had ends with an error event that says why it was not continued, never a hang."""
    cluster.refresh()
    decode = cluster.engine("decode")
    send = mixed_send(cluster.proxy_url, MODEL, "describe the sea")
    results, kill = kill_under_load(decode["pid"], len(CLIENT_MIX), send, lambda r: r[3]["path"] == "disaggregated")

    outcome = kill_outcome(results, kill)
    print(f"decode kill under load: {outcome}")
    assert outcome.in_flight and not outcome.failed, outcome.failed
    assert outcome.continued, outcome
    assert all(r.seen["migrated"] == decode["engine_id"] for r in outcome.moved)
    assert all(r.seen["path"] == "prefill-only; reason=decode-failed" for r in outcome.moved), outcome.moved
    assert all(f"decode engine {decode['engine_id']} failed after" in r.seen["comments"][0] for r in outcome.continued)
    assert all("could not be continued: it samples (temperature 0.8" in r.seen["error"]["message"]
               for r in outcome.sampled_ended)  # fmt: skip
    wait_restarted(cluster, "decode", decode["pid"])
    compared = answers_equal(cluster.proxy_url, outcome.to_compare())
    print(f"decode kill under load: {compared} answers compared with the decode engine's own, all equal")


def path_of(headers: dict) -> str:
    return {name.lower(): value for name, value in headers.items()}.get("x-pdserve-path", "")
