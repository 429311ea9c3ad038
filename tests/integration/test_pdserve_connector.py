"""Our own connector under faults, end to end: real Ray, real vLLM CPU engines, real NIXL.

The shared suite (test_stack.py) already runs against ``connector: pdserve``.
This cluster of its own turns fault injection on: half of the decode
engine's KV reads fail, each handshake answer is delayed, leases are short.
It proves that a failed read is recomputed with the same greedy answer, that
blocks nobody reads are released at once (by the decode engine after a
failed read, by the proxy after a failed decode leg) or freed at lease
expiry, and that all of it shows in the engines' ``pdserve:kv_*`` metrics and
the ``X-PDServe-KV`` header; that a release (the proxy's message, which travels in
plaintext) sent while a decode engine reads the blocks is refused and the READ
served; and that a hostile side-channel client (a 1 GiB announcement, a hundred
connections of 1 MiB, a flood of junk) costs the engine a bounded amount of memory
and no request. It starts after the shared cluster is stopped: the machine has
cores for one cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import psutil
import pytest

from contract.framing import MAGIC, frame
from contract.wire import parse_tcp_endpoint
from tests.integration.conftest import (
    engine_headers,
    http_json,
    http_stream,
    kv_report,
    metric_values,
    own_cluster,
    run_pdserve,
)

pytestmark = [pytest.mark.integration, pytest.mark.after_cluster]

MODEL = "smollm2-135m-instruct"
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 plus 30?",
    "What do bees make?",
    "Which planet is known as the red planet?",
    "How many legs does a spider have?",
    "What is the boiling point of water in Celsius?",
    "Who wrote Romeo and Juliet?",
]
LEASE_TTL_S = 20
SPEC = {
    "name": "pdserve-faults",
    "model": MODEL,
    "device": "cpu",
    "connector": "pdserve",
    "connector_options": {
        "lease_ttl_s": LEASE_TTL_S,
        "handshake_timeout_s": 5,
        # read_hold_s: each READ is posted 3 s after its pin, so a release or a flood can come while it is read
        "fault_injection": {"read_failure_rate": 0.5, "handshake_delay_s": 1.0, "read_hold_s": 3.0, "seed": 1},
    },
    "proxy": {"port": 21000},
    "prefill": {"replicas": 1, "cpu_cores": 1, "port": 21100, "kv_port": 17600},
    "decode": {"replicas": 1, "cpu_cores": 1, "port": 21200, "kv_port": 17700},
    "engine": {"max_model_len": 4096, "kv_cache_gib": 1},
}
FAILURES = "pdserve:kv_transfer_failures_total"
LEASES = "pdserve:kv_leases_total"


def chat(prompt: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], **extra}


@pytest.fixture(scope="module")
def pdserve_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    with own_cluster(tmp_path_factory.mktemp("pdserve-connector"), SPEC) as status:
        yield status


def headers_of(status: dict) -> dict[str, str]:
    return engine_headers(status["state_dir"])


def engine_url(status: dict, role: str) -> str:
    return next(e["url"] for e in status["engines"] if e["role"] == role)


def metric_total(base_url: str, name: str) -> float:
    """A label-less counter's value (summed over vLLM's model/engine labels)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def eventually(read: Callable[[], object], expected: object, timeout_s: float = 15) -> object:
    """Poll ``read()`` until it equals ``expected`` (metrics are published once per engine step)."""
    deadline = time.monotonic() + timeout_s
    while (value := read()) != expected and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


def test_failed_reads_are_recomputed_with_the_same_greedy_answer(pdserve_cluster: dict) -> None:
    decode_url = engine_url(pdserve_cluster, "decode")
    prefill_url = engine_url(pdserve_cluster, "prefill")
    failures_before = metric_values(decode_url, FAILURES, "kind").get("injected", 0)
    recomputed_before = metric_total(decode_url, "pdserve:kv_recomputed_tokens_total")
    leases_before = metric_values(prefill_url, LEASES, "outcome")
    sources, recomputed_tokens = [], 0
    for prompt in PROMPTS:
        request = chat(prompt, temperature=0, max_tokens=24)
        status, _, alone = http_json(prefill_url + "/v1/chat/completions", request, headers=headers_of(pdserve_cluster))
        assert status == 200, alone
        status, headers, disaggregated = http_json(pdserve_cluster["proxy_url"] + "/v1/chat/completions", request)
        assert status == 200, disaggregated
        assert disaggregated["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
        report = kv_report(headers)
        sources.append(report["source"])
        if report["source"] == "recomputed":
            assert report["reason"] == "injected", report
            recomputed_tokens += disaggregated["usage"]["prompt_tokens"]
        else:
            assert report["source"] == "transfer" and int(report["bytes"]) > 0, report

    failed, read = sources.count("recomputed"), sources.count("transfer")
    assert failed and read, sources  # seed 1 fails some reads and not others
    assert eventually(lambda: metric_values(decode_url, FAILURES, "kind").get("injected", 0) - failures_before, failed)
    recomputed = metric_total(decode_url, "pdserve:kv_recomputed_tokens_total") - recomputed_before
    assert recomputed == recomputed_tokens
    # Every prefill lease ended at once: read by the decode engine, or released by it after
    # the failed read; none waited for expiry.
    expected = {"read": read, "released": failed, "expired": 0}
    assert eventually(lambda: lease_deltas(prefill_url, leases_before), expected) == expected
    assert metric_total(decode_url, "pdserve:kv_transfer_bytes_total") > 0


def test_a_streams_header_says_whether_its_kv_came_over_the_wire_or_was_recomputed(pdserve_cluster: dict) -> None:
    sources = []
    for prompt in PROMPTS:
        headers: dict[str, str] = {}
        events = http_stream(
            pdserve_cluster["proxy_url"] + "/v1/chat/completions",
            chat(prompt, temperature=0, max_tokens=8, stream=True),
            headers=headers,
        )
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]), prompt
        report = kv_report(headers)
        sources.append(report["source"])
        if report["source"] == "recomputed":
            assert report["reason"] == "injected", report
        else:
            assert report["source"] == "transfer" and int(report["bytes"]) > 0, report
    assert "recomputed" in sources and "transfer" in sources, sources


def test_a_failed_decode_leg_releases_the_prefill_blocks_at_once(pdserve_cluster: dict) -> None:
    """The decode engine refuses the request after the prefill kept its blocks: the proxy releases them."""
    prefill_url = engine_url(pdserve_cluster, "prefill")
    before = metric_values(prefill_url, LEASES, "outcome")
    # min_tokens is dropped for the prefill leg (max_tokens=1 there); vLLM refuses it on the decode leg.
    request = chat(PROMPTS[0], temperature=0, max_tokens=2, min_tokens=5)
    status, _, body = http_json(pdserve_cluster["proxy_url"] + "/v1/chat/completions", request)

    assert status == 400, body
    assert body["error"]["type"] in ("BadRequestError", "invalid_request_error"), body
    expected = {"read": 0, "released": 1, "expired": 0}
    assert eventually(lambda: lease_deltas(prefill_url, before), expected, timeout_s=LEASE_TTL_S / 2) == expected


def test_blocks_nobody_reads_are_freed_when_the_lease_expires(pdserve_cluster: dict) -> None:
    """A prefill that no decode engine follows (and nobody releases) holds its blocks for lease_ttl_s only."""
    prefill_url = engine_url(pdserve_cluster, "prefill")
    before = metric_values(prefill_url, LEASES, "outcome")
    request = chat(PROMPTS[1], max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    status, _, body = http_json(prefill_url + "/v1/chat/completions", request, headers=headers_of(pdserve_cluster))
    assert status == 200, body
    assert body["kv_transfer_params"]["remote_block_ids"], body

    expected = {"read": 0, "released": 0, "expired": 1}
    assert eventually(lambda: lease_deltas(prefill_url, before), expected, timeout_s=LEASE_TTL_S + 20) == expected


def lease_deltas(
    prefill_url: str, before: dict[str, float], outcomes: Iterable[str] = ("read", "released", "expired")
) -> dict[str, float]:
    after = metric_values(prefill_url, LEASES, "outcome")
    return {outcome: after.get(outcome, 0) - before.get(outcome, 0) for outcome in outcomes}


def test_the_spec_selected_our_connector_with_its_faults(pdserve_cluster: dict) -> None:
    log_dir = Path(pdserve_cluster["log_dir"])
    logs = "".join(path.read_text(errors="replace") for path in log_dir.glob("*.log"))

    assert "PdserveConnector" in logs
    assert "handshake side channel listening" in logs
    assert "fault injection (read_failure_rate=0.5)" in logs


def test_a_release_sent_while_the_kv_is_being_read_is_refused_and_the_read_served(pdserve_cluster: dict) -> None:
    """The test plays the proxy: prefill, then the decode leg, and while the decode engine reads (a pin counted
    on the prefill engine, the READ posted 3 s after it), the prefill's own release message. Before pins the
    release freed the blocks under the READ; now it is refused, the lease ends read, and the answer is the one
    engine's."""
    prefill_url = engine_url(pdserve_cluster, "prefill")
    outcomes = ("read", "released", "expired", "release_refused")
    late = {"read": 1, "released": 0, "expired": 0, "release_refused": 0}
    seen = []
    for prompt in PROMPTS:  # half the reads fail by injection (then nothing is pinned): until one is read
        before = metric_values(prefill_url, LEASES, "outcome")
        alone, body, pinned = release_while_reading(pdserve_cluster, chat(prompt, temperature=0, max_tokens=16))
        assert body["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
        source = body["kv_transfer_params"]["pdserve_kv"]["source"]
        if not pinned:  # the READ failed by injection (or landed before the releaser saw its pin)
            continue
        assert source == "transfer", body
        after = eventually_settled(lambda before=before: lease_deltas(prefill_url, before, outcomes))
        seen.append(after)
        if after == late:  # the release came after the READ had landed (the lease ended read first): again
            continue
        assert after == {"read": 1, "released": 0, "expired": 0, "release_refused": 1}
        return
    pytest.fail(f"no release of the prompts came under a pin (each pinned READ's lease deltas: {seen})")


def eventually_settled(read: Callable[[], dict[str, float]], timeout_s: float = 15) -> dict[str, float]:
    """``read()`` once the lease it counts has ended (read, released or expired), or at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while sum((value := read())[o] for o in ("read", "released", "expired")) < 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


def release_while_reading(cluster: dict, request: dict) -> tuple[dict, dict, bool]:
    """``(answer of the prefill engine alone, the decode leg's answer, whether the release went under a pin)``.

    The release is sent by ``tests.integration.release_when_pinned``, started before the legs, as soon as it sees
    the pin (while a READ waits, a process of the test's can wait seconds for a CPU: see that module)."""
    prefill_url, decode_url = engine_url(cluster, "prefill"), engine_url(cluster, "decode")
    headers = headers_of(cluster)
    releaser = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.release_when_pinned"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        start_new_session=True,
    )
    try:
        status, _, alone = http_json(prefill_url + "/v1/chat/completions", request, headers=headers)
        assert status == 200, alone
        prefill_leg = dict(request, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        status, _, prefilled = http_json(prefill_url + "/v1/chat/completions", prefill_leg, headers=headers)
        assert status == 200, prefilled
        params = prefilled["kv_transfer_params"]
        release = params["pdserve_release"]
        job = {
            "prefill_url": prefill_url,
            "pins_before": metric_values(prefill_url, LEASES, "outcome").get("pinned", 0),
            "endpoints": release["endpoints"],
            "message": release["message"],
            "deadline_s": 30,
        }
        releaser.stdin.write(json.dumps(job) + "\n")
        releaser.stdin.flush()
        decode_leg = dict(request, kv_transfer_params=params)
        status, _, body = http_json(decode_url + "/v1/chat/completions", decode_leg, headers=headers)
        assert status == 200, body
        with contextlib.suppress(BrokenPipeError):  # it may have sent the release and ended
            releaser.stdin.write("answered\n")  # no pin seen by now: nothing was pinned (the READ failed by injection)
            releaser.stdin.flush()
        out = releaser.stdout.readline()
        releaser.wait(timeout=60)
    finally:
        if releaser.poll() is None:
            releaser.kill()
    sent = json.loads(out) if out.strip() else {"sent": False, "answered": False}
    assert sent["answered"] or not sent["sent"], sent
    return alone, body, sent["sent"]


def test_a_hostile_side_channel_client_costs_bounded_memory_and_no_request(pdserve_cluster: dict) -> None:
    """Unauthenticated: a 1 GiB announcement, 100 connections each announcing 1 MiB and trickling it, 3 s of
    junk frames. The engine's process tree grows by less than the channel's bound (64 connections of 1 MiB)
    plus slack, no engine restarts, and the next request is read over the wire with the one engine's answer."""
    prefill = next(e for e in pdserve_cluster["engines"] if e["role"] == "prefill")
    host, port = parse_tcp_endpoint(prefill["kv_endpoints"][0])

    def tree_rss() -> int:
        root = psutil.Process(prefill["pid"])
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])

    rss_before = tree_rss()
    giant = socket.create_connection((host, port), timeout=5)
    giant.sendall(MAGIC + (1 << 30).to_bytes(4, "big") + b"x" * 65536)
    trickling = []
    for _ in range(100):
        connection = socket.create_connection((host, port), timeout=5)
        trickling.append(connection)
        try:  # all but the last byte; the server drops connections past its cap (then this one's send fails)
            connection.sendall(MAGIC + (1 << 20).to_bytes(4, "big") + b"y" * ((1 << 20) - 1))
        except OSError:
            pass
    peak = tree_rss()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        with socket.create_connection((host, port), timeout=5) as junk:
            junk.sendall(frame(b"not sealed " * 100))
            junk.settimeout(5)
            assert junk.recv(4096)  # answered (ERR), not ignored
        peak = max(peak, tree_rss())
    for connection in [giant, *trickling]:
        connection.close()
    growth_mib = (peak - rss_before) / 2**20
    print(f"hostile side-channel client: the prefill engine's tree grew {growth_mib:.0f} MiB at most")
    assert growth_mib < 64 + 64, growth_mib

    status, headers, body = http_json(
        pdserve_cluster["proxy_url"] + "/v1/chat/completions", chat(PROMPTS[3], temperature=0, max_tokens=8)
    )
    assert status == 200, body
    engines = {e["engine_id"]: e["pid"] for e in pdserve_cluster["engines"]}
    now = run_pdserve("status", "--json", env=dict(os.environ, PDSERVE_STATE_DIR=pdserve_cluster["state_dir"]))
    status_now = {e["engine_id"]: e["pid"] for e in json.loads(now.stdout)["engines"]}
    assert status_now == engines  # no engine restarted
