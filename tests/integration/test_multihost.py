"""P/D across hosts: the three-host test bed (testlib/testbed: network namespaces on a bridge,
198.18.0.10-12, one Ray node each), configs/multi-host-cpu.yaml started from the head host.

What a user of a multi-host cluster sees: engines on the hosts their pools name, serving at those
hosts' addresses; every request's KV moved from the prefill host to the decode host (the bridge
carried it); answers equal to the decode engine's alone; and when the decode host is lost, requests
fail fast (no hang) while `pdserve status` names the lost host, and the service comes back with it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from testlib import testbed as hosts
from tests.integration.conftest import CLI_TIMEOUT_S, PDSERVE, UP_TIMEOUT_S, engine_headers, http_json, kv_report

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "configs" / "multi-host-cpu.yaml"
HOSTS = ("head", "prefill", "decode")
IPS = {"head": "198.18.0.10", "prefill": "198.18.0.11", "decode": "198.18.0.12"}
MODEL = "smollm2-135m-instruct"
PROMPTS = ("Name three colors.", "What is the capital of France?", "Count from one to five.")

pytestmark = [
    pytest.mark.after_cluster,  # its engines need the machine's cores: after the shared cluster is gone
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2"),
]


class MultiHost:
    def __init__(self, root: Path) -> None:
        self.env = dict(os.environ, PDSERVE_STATE_DIR=str(root / "state"))
        self.env.pop("RAY_ADDRESS", None)
        self.status: dict = {}

    def pdserve(self, *args: str, host: str | None = "head", timeout: float = CLI_TIMEOUT_S):
        argv = [*PDSERVE, *args] if host is None else hosts.exec_argv(host, [*PDSERVE, *args])
        return subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd=ROOT
        )

    def refresh(self) -> dict:
        # From this machine's own namespace: the control API is reached over the bridge.
        result = self.pdserve("status", "--json", host=None, timeout=60)
        assert result.returncode == 0, result.stderr
        self.status = json.loads(result.stdout)
        return self.status

    def engine(self, engine_id: str) -> dict:
        return next(e for e in self.status["engines"] if e["engine_id"] == engine_id)

    def host(self, ip: str) -> dict:
        return next(h for h in self.status["hosts"] if h["ip"] == ip)


def scalable_spec() -> dict:
    """configs/multi-host-cpu.yaml with room to scale by hand (no autoscaler decisions: no profile)."""
    spec = yaml.safe_load(SPEC.read_text())
    return spec | {
        "resources": spec["resources"] | {"share_cores": True},
        # Three engines on two cores: a starved engine answers a handshake late, and a prefill engine being
        # scaled away holds blocks nobody read until their lease ends.
        "connector_options": {"handshake_timeout_s": 20, "lease_ttl_s": 20},
        "engine": spec["engine"] | {"drain_timeout_s": 60},
        "autoscaling": {
            "prefill": {"min": 1, "max": 2},
            "decode": {"min": 1, "max": 3},  # the decode host's Ray node has 2 CPUs: a third engine cannot fit
            "max_engines": 5,
            "targets": {"ttft_p90_s": 30, "itl_p90_s": 5},
        },
    }


@pytest.fixture(scope="module")
def multihost(three_hosts: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiHost]:
    root = tmp_path_factory.mktemp("multihost")
    cluster = MultiHost(root)
    spec_path = root / "cluster.yaml"
    spec_path.write_text(yaml.safe_dump(scalable_spec()))
    try:
        started = time.monotonic()
        up = cluster.pdserve("up", str(spec_path), "--detach", timeout=UP_TIMEOUT_S)
        assert up.returncode == 0, f"pdserve up on three hosts failed:\n{up.stdout}\n{up.stderr}"
        print(f"pdserve up on three hosts: ready in {time.monotonic() - started:.1f} s")
        cluster.refresh()
        yield cluster
    finally:
        down = cluster.pdserve("down", timeout=300)
        assert down.returncode == 0, down.stderr


def chat(url: str, prompt: str, timeout: float = 120, headers: dict | None = None) -> tuple[int, dict, dict]:
    """A greedy chat completion: (status, body, headers)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "temperature": 0}
    code, headers, answer = http_json(url + "/v1/chat/completions", body, timeout=timeout, headers=headers)
    return code, answer, headers


def veth_bytes(host: str) -> tuple[int, int]:
    """(bytes the host sent, bytes it received), counted on its veth's end in this namespace."""
    index = HOSTS.index(host)
    stats = Path(f"/sys/class/net/{hosts.VETH_PREFIX}{index}/statistics")
    return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())


def test_engines_run_on_their_pools_hosts_and_serve_at_those_addresses(multihost):
    status = multihost.status
    assert status["phase"] == "ready"
    assert status["proxy_url"] == f"http://{IPS['head']}:8000"
    prefill, decode = multihost.engine("prefill-0"), multihost.engine("decode-0")
    assert (prefill["host"], prefill["url"]) == (IPS["prefill"], f"http://{IPS['prefill']}:8100")
    assert (decode["host"], decode["url"]) == (IPS["decode"], f"http://{IPS['decode']}:8200")
    assert decode["kv_endpoints"] == [f"tcp://{IPS['decode']}:5700"]
    assert {h["ip"]: (h["alive"], h["engines"]) for h in status["hosts"]} == {
        IPS["head"]: (True, []),
        IPS["prefill"]: (True, ["prefill-0"]),
        IPS["decode"]: (True, ["decode-0"]),
    }
    assert multihost.host(IPS["head"])["head"] is True


def test_kv_crosses_hosts_and_answers_equal_the_decode_engine_alone(multihost):
    proxy, decode_url = multihost.status["proxy_url"], multihost.engine("decode-0")["url"]
    sent_before = veth_bytes("prefill")[0]
    moved = 0
    for prompt in PROMPTS:
        code, body, headers = chat(proxy, prompt)
        assert code == 200, body
        report = kv_report(headers)
        assert report["source"] == "transfer", report
        assert report["remote_engine_id"] == "prefill-0"
        moved += int(report["bytes"])
        alone_code, alone, _ = chat(decode_url, prompt, headers=engine_headers(multihost.env["PDSERVE_STATE_DIR"]))
        assert alone_code == 200, alone
        assert body["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
    sent = veth_bytes("prefill")[0] - sent_before
    assert moved > 0 and sent >= moved, f"the prefill host sent {sent} bytes, the KV reports say {moved}"


def test_scaling_places_new_engines_on_their_pools_hosts(multihost):
    refused = multihost.pdserve("scale", "decode=3", host=None)
    assert refused.returncode == 1
    assert "cannot hold that: decode: decode-2 needs CPU 1" in refused.stderr
    assert f"{IPS['decode']}: CPU 0" in refused.stderr
    grown = multihost.pdserve("scale", "prefill=2", host=None, timeout=900)
    assert grown.returncode == 0, grown.stdout + grown.stderr
    multihost.refresh()
    assert multihost.engine("prefill-1")["host"] == IPS["prefill"]
    assert multihost.engine("prefill-1")["url"] == f"http://{IPS['prefill']}:8101"
    # Round robin reaches the new engine. (Its KV may be recomputed instead of read: three engines on
    # this machine's two cores can starve a just-started engine's side channel past the handshake timeout.)
    # A prefill the starved engine fails is tried on the other, then served decode-only (no X-PDServe-Prefill):
    # every request is answered; round robin must reach both prefill engines within a few.
    served_by = set()
    for n in range(8):
        code, body, headers = chat(multihost.status["proxy_url"], f"Say the number {n}.", timeout=300)
        assert code == 200, body
        served_by.add({k.lower(): v for k, v in headers.items()}.get("x-pdserve-prefill"))
        if {"prefill-0", "prefill-1"} <= served_by:
            break
    assert {"prefill-0", "prefill-1"} <= served_by <= {"prefill-0", "prefill-1", None}
    shrunk = multihost.pdserve("scale", "prefill=1", host=None, timeout=900)
    assert shrunk.returncode == 0, shrunk.stdout + shrunk.stderr
    assert "prefill-1 stopped" in shrunk.stdout
    assert {e["engine_id"] for e in multihost.refresh()["engines"]} == {"prefill-0", "decode-0"}


def test_losing_the_decode_host_degrades_and_the_service_returns_with_it(multihost):
    proxy = multihost.status["proxy_url"]
    hosts.kill_host("decode", wait_dead=True, timeout_s=60)
    lost_at = time.monotonic()
    # While no decode engine exists, the prefill engine serves requests whole: once the proxy has
    # ejected the lost engine, none waits on it or fails (before that, a request may fail fast: 502).
    deadline = time.monotonic() + 60
    while True:
        started = time.monotonic()
        code, body, headers = chat(proxy, PROMPTS[0], timeout=120)
        assert time.monotonic() - started < 60, "a request waited on a lost host"
        path = {k.lower(): v for k, v in headers.items()}.get("x-pdserve-path")
        if code == 200 and path == "prefill-only; reason=no-decode-engine":
            break
        assert code in (200, 502), body
        assert time.monotonic() < deadline, f"not served without the decode host 60 s after it was lost: {code}"
    status = multihost.refresh()
    assert multihost.host(IPS["decode"])["alive"] is False
    assert multihost.engine("decode-0")["state"] in ("restarting", "starting"), multihost.engine("decode-0")
    assert status["pools"]["decode"]["ready"] == 0
    # The host comes back: Ray restarts the engine actor there, the controller starts vLLM in it.
    hosts.restart_host("decode")
    deadline = time.monotonic() + 300
    while multihost.refresh()["pools"]["decode"]["ready"] < 1:
        assert time.monotonic() < deadline, f"decode-0 not ready 300 s after its host returned: {multihost.status}"
        time.sleep(2)
    print(f"service back {time.monotonic() - lost_at:.1f} s after the decode host was lost")
    assert multihost.host(IPS["decode"])["alive"] is True
    assert multihost.engine("decode-0")["host"] == IPS["decode"]
    # The proxy's health checks admit it again, and KV crosses hosts again (a first handshake with the
    # restarted engine may still time out on this machine: that request is recomputed, the next reads).
    deadline, seen = time.monotonic() + 60, []
    while True:
        code, _, headers = chat(proxy, f"{PROMPTS[1]} ({len(seen)})")
        named = {k.lower(): v for k, v in headers.items()}
        source = kv_report(headers)["source"] if "x-pdserve-kv" in named else None
        seen.append((code, named.get("x-pdserve-path"), source))
        if seen[-1] == (200, "disaggregated", "transfer"):
            break
        assert time.monotonic() < deadline, seen
        time.sleep(1)


def test_the_spec_validates_against_the_beds_nodes(multihost):
    result = multihost.pdserve("validate", str(SPEC), "--ray-address", f"{IPS['head']}:6379")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"  host {IPS['prefill']}:" in result.stdout and f"  host {IPS['decode']}:" in result.stdout
    wrong = yaml.safe_load(SPEC.read_text())
    wrong["decode"]["placement"]["node_labels"] = {"pdserve.io/pool": "gpu-decode"}
    path = Path(multihost.env["PDSERVE_STATE_DIR"]).parent / "wrong.yaml"
    path.write_text(yaml.safe_dump(wrong))
    result = multihost.pdserve("validate", str(path), "--ray-address", f"{IPS['head']}:6379")
    assert result.returncode == 1
    assert "cannot place: decode.placement: no alive Ray node is one of nodes with pdserve.io/pool=gpu-decode" in (
        result.stdout
    )
