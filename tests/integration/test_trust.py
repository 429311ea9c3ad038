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
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from connectors.framing import FramingError, recv_frame
from connectors.handshake import HandshakeRequest, encode_request
from connectors.side_messages import MAX_REQUEST_BYTES
from contract import wire
from contract.auth import KVAuth, read_secret_file
from tests.integration.conftest import Cluster, http_json, kv_report, metric_values
from tests.unit.connectors.test_side_channel import ask

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
    """kill -9 of the decode engine under load (non-streamed, greedy): each request it had is handed to the
    prefill engine, which answers it alone (``decode_retries``, ``degrade``), and its answer is the one the
    decode engine gives once it is back."""
    cluster.refresh()
    decode = cluster.engine("decode")

    def send(n: int, i: int) -> tuple[int, dict, str]:  # (status, headers and the answer's text, question)
        question = f"Client {n}, question {i}: name three fruits."
        try:
            status, headers, answer = http_json(
                cluster.proxy_url + "/v1/chat/completions", chat(question, max_tokens=16), timeout=300
            )
            headers = {name.lower(): value for name, value in headers.items()}
            headers["text"] = answer["choices"][0]["message"]["content"] if status == 200 else str(answer)
        except OSError as e:
            status, headers = 0, {"text": f"no answer: {e}"}
        return status, headers, question

    results, kill = kill_under_load(decode["pid"], 6, send, lambda r: path_of(r[3]) == "disaggregated")

    in_flight = [r for r in results if r[0] < kill < r[1]]
    failed = [r for r in results if r[2] != 200]
    moved = [r for r in results if "x-pdserve-migrated" in r[3]]
    print(
        f"decode kill under load: {len(results)} requests, {len(in_flight)} in flight at the kill, "
        f"{len(failed)} failed, {len(moved)} moved to another engine"
    )
    assert in_flight and not failed, failed
    assert all(r[3]["x-pdserve-migrated"] == decode["engine_id"] for r in moved)
    assert all(path_of(r[3]) == "prefill-only; reason=decode-failed" for r in moved), moved
    wait_restarted(cluster, "decode", decode["pid"])
    # The answers the prefill engine gave for the decode engine are those the decode engine gives once back.
    for _, _, _, headers, question in [r for r in in_flight if r in moved][:3]:
        status, again, answer = http_json(
            cluster.proxy_url + "/v1/chat/completions", chat(question, max_tokens=16), timeout=300
        )
        assert status == 200 and path_of(again) == "disaggregated"
        assert answer["choices"][0]["message"]["content"] == headers["text"], question


def stream_of(url: str, body: dict) -> tuple[int, dict]:
    """A streamed request's status and what the client saw: its text, usage, error, SSE comments, path."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    seen: dict = {"text": "", "usage": None, "error": None, "comments": [], "done": 0, "ids": set()}
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            status, seen["path"] = response.status, response.headers.get("x-pdserve-path", "")
            raw = response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, seen | {"error": e.read().decode()}
    except OSError as e:
        return 0, seen | {"error": f"no answer: {e}"}
    for block in filter(None, raw.split("\n\n")):
        if block.startswith(":"):
            seen["comments"].append(block)
        elif block == "data: [DONE]":
            seen["done"] += 1
        else:
            event = json.loads(block.removeprefix("data: "))
            if "error" in event:
                seen["error"] = event["error"]
                continue
            seen["ids"].add(event["id"])
            seen["usage"] = event.get("usage") or seen["usage"]
            for choice in event["choices"]:
                seen["text"] += choice["delta"].get("content") or "" if "delta" in choice else choice["text"]
    return status, seen


def test_killing_the_only_decode_engine_mid_stream_continues_its_streams(cluster: Cluster) -> None:
    """kill -9 of the decode engine under greedy streams (chat and completions): each stream it had goes on on
    the prefill engine from the tokens already sent (``proxy.continuation``); the client sees one unbroken
    stream, whose text and usage are those of the same request uninterrupted once the decode engine is back.
    A sampled stream it had ends with an error event that says why it was not continued, never a hang."""
    cluster.refresh()
    decode = cluster.engine("decode")
    greedy = {"temperature": 0, "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}}

    def send(n: int, i: int) -> tuple[int, dict, str, dict]:
        question = f"Client {n}, question {i}: describe the sea."
        if n == 5:  # sampled: not continued
            path, body = "/v1/chat/completions", chat(question) | greedy | {"temperature": 0.8, "seed": i}
        elif n % 2 == 0:
            path, body = "/v1/chat/completions", chat(question) | greedy
        else:
            path, body = "/v1/completions", {"model": MODEL, "prompt": question} | greedy
        status, seen = stream_of(cluster.proxy_url + path, body)
        return status, seen, path, body

    results, kill = kill_under_load(decode["pid"], 6, send, lambda r: r[3]["path"] == "disaggregated")

    greedy_streams = [r for r in results if r[5]["temperature"] == 0]
    in_flight = [r for r in greedy_streams if r[0] < kill < r[1]]
    failed = [r for r in greedy_streams if r[2] != 200 or r[3]["error"] or r[3]["done"] != 1]
    continued = [r for r in greedy_streams if r[3]["comments"]]
    sampled_ended = [r for r in results if r[5]["temperature"] != 0 and r[3]["error"]]
    print(
        f"decode kill under streams: {len(greedy_streams)} greedy streams, {len(in_flight)} in flight at the kill, "
        f"{len(failed)} failed, {len(continued)} continued on another engine; "
        f"{len(sampled_ended)} sampled streams ended with an error event"
    )
    assert in_flight and not failed, failed
    assert continued and all(len(r[3]["ids"]) == 1 for r in greedy_streams), continued  # one stream id each
    assert all(f"decode engine {decode['engine_id']} failed after" in r[3]["comments"][0] for r in continued)
    for *_, seen, _, _ in sampled_ended:  # said, not a silent truncation
        assert "could not be continued: it samples (temperature 0.8" in seen["error"]["message"], seen
    wait_restarted(cluster, "decode", decode["pid"])
    # Each continued stream is the one the decode engine streams alone, token for token, usage and all.
    for _, _, _, seen, path, body in continued[:4]:
        status, again = stream_of(cluster.proxy_url + path, body)
        assert status == 200 and again["path"] == "disaggregated" and not again["comments"], again
        assert (seen["text"], seen["usage"]) == (again["text"], again["usage"]), (seen, again)
    print(f"decode kill under streams: {min(len(continued), 4)} continued streams compared, all equal")


def kill_under_load(
    pid: int, clients: int, send: Callable[[int, int], tuple], disaggregated: Callable[[tuple], bool]
) -> tuple[list[tuple], float]:
    """``clients`` threads each send requests one after another (``send(n, i)``: client n's i-th, its outcome);
    once ``clients`` results are ``disaggregated``, kill -9 ``pid``; they go on until ``clients`` requests were
    sent 2 s after the kill. Returns each request's ``(sent, answered, *outcome)`` and when the kill came."""
    results: list[tuple] = []
    stop = threading.Event()

    def client(n: int) -> None:
        i = 0
        while not stop.is_set():
            sent = time.monotonic()
            outcome = send(n, i)
            results.append((sent, time.monotonic(), *outcome))
            i += 1

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(clients)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while sum(1 for r in results if disaggregated(r)) < clients and time.monotonic() < deadline:
        time.sleep(0.2)
    kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while sum(1 for r in results if r[0] > kill + 2) < clients and time.monotonic() < deadline:
        time.sleep(0.2)
    stop.set()
    for thread in threads:
        thread.join(timeout=300)
    return results, kill


def path_of(headers: dict) -> str:
    return {name.lower(): value for name, value in headers.items()}.get("x-pdserve-path", "")
