"""The whole stack on this machine: YAML -> Ray -> vLLM CPU engines -> NIXL -> proxy.

Every test talks to the cluster the way a user does (HTTP to the proxy, the
``pdserve`` CLI) and reads the engines' own endpoints only to check what the
proxy cannot show: the reference answer of one engine alone, and the decode
engine's metrics that prove the prompt's KV arrived over the connector.
"""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from orchestrator import shm
from tests.integration.conftest import (
    ADAPTER,
    Cluster,
    http_json,
    http_stream,
    kv_report,
    metric_values,
    run_pdserve,
)

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
    "What is 12 plus 30?",
    "Give me a tip for learning to cook.",
    "Which planet is known as the red planet?",
    "Describe a cat in five words.",
    "What do bees make?",
]
SOURCE_METRIC = "vllm:prompt_tokens_by_source_total"


def chat(prompt: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], **extra}


# The progress `up` prints is the controller's, whatever the connector: on our connector's cluster only (with
# vLLM's NixlConnector every engine spins a core, and each `pdserve status` of this test took a minute).
@pytest.mark.parametrize("cluster", ["pdserve"], indirect=True)
def test_up_reported_progress_and_load_times(cluster: Cluster) -> None:
    out = cluster.up_output
    phases = ["actor placed", "vLLM imported", "engine core started", "weights loaded", "KV cache allocated"]
    for engine in ("prefill-0", "decode-0"):
        assert f"{engine} loading (cores" in out
        assert f"{engine} ready in" in out
        for phase in phases:  # each phase of its start, said as it ended
            assert f"{engine}: {phase} (+" in out
    assert "cluster 'pdserve-test' is ready in" in out
    status = cluster.refresh()
    assert status["phase"] == "ready"
    assert {e["engine_id"]: e["state"] for e in status["engines"]} == {"prefill-0": "ready", "decode-0": "ready"}
    assert sorted(e["cpu_bind"] for e in status["engines"]) == ["0", "1"]  # each engine on its own core
    assert all(e["load_s"] > 0 for e in status["engines"])
    for engine in status["engines"]:  # where each start's time went, in order
        assert [p["phase"] for p in engine["phases"]] == [*phases, "warmed up", "ready"]
        seconds = [p["s"] for p in engine["phases"]]
        assert seconds == sorted(seconds) and seconds[-1] >= engine["load_s"] - 1


# vLLM's NixlConnector keeps its smoke tests (progress, greedy equality, nothing left behind); the proxy's own
# behaviour is checked on our connector's cluster only (vLLM's engines spin their cores and double the time).
@pytest.mark.parametrize("cluster", ["pdserve"], indirect=True)
def test_chat_answer_says_paris(cluster: Cluster) -> None:
    # Exactly the README's curl: no sampling fields, the model's defaults apply.
    status, headers, body = http_json(cluster.proxy_url + "/v1/chat/completions", chat(PROMPTS[0]))
    assert status == 200, body
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert headers["x-pdserve-prefill"] == "prefill-0"
    assert headers["x-pdserve-decode"] == "decode-0"


def test_disaggregated_greedy_output_equals_one_engine_alone(cluster: Cluster) -> None:
    """Prefill->decode through the proxy gives the same greedy text as one engine alone;
    and the decode engine computed none of those prompts: their KV came over NIXL."""
    decode_url = cluster.engine("decode")["url"]
    prefill_url = cluster.engine("prefill")["url"]
    before = metric_values(decode_url, SOURCE_METRIC, "source")
    prompt_tokens = 0
    for prompt in PROMPTS:
        request = chat(prompt, temperature=0, max_tokens=16)  # KV read wrong shows from the first token
        status, _, alone = http_json(prefill_url + "/v1/chat/completions", request, headers=cluster.engine_headers)
        assert status == 200, alone
        status, headers, disaggregated = http_json(cluster.proxy_url + "/v1/chat/completions", request)
        assert status == 200, disaggregated
        assert disaggregated["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
        assert disaggregated["usage"] == alone["usage"]
        prompt_tokens += disaggregated["usage"]["prompt_tokens"]
        if cluster.connector == "pdserve":  # ours says, per request, that the KV came over the wire
            report = kv_report(headers)
            assert report["source"] == "transfer" and int(report["bytes"]) > 0, report
            assert float(report["transfer_ms"]) > 0 and report["remote_engine_id"] == "prefill-0"
    after = metric_values(decode_url, SOURCE_METRIC, "source")
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == prompt_tokens
    assert after["local_compute"] - before["local_compute"] == 0


@pytest.mark.parametrize("cluster", ["pdserve"], indirect=True)
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streaming_yields_the_same_text_as_non_streaming(cluster: Cluster, kind: str) -> None:
    if kind == "chat":
        path, request = "/v1/chat/completions", chat("Tell me about Paris.", temperature=0, max_tokens=40)
    else:
        path = "/v1/completions"
        request = {
            "model": MODEL,
            "prompt": "The three largest cities of France are",
            "temperature": 0,
            "max_tokens": 40,
        }
    status, whole_headers, whole = http_json(cluster.proxy_url + path, request)
    assert status == 200, whole
    headers: dict[str, str] = {}
    events = http_stream(cluster.proxy_url + path, dict(request, stream=True), headers=headers)
    if kind == "chat":
        expected = whole["choices"][0]["message"]["content"]
        streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    else:
        expected = whole["choices"][0]["text"]
        streamed = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert len(events) > 5  # tokens arrived as a stream, not as one block
    assert streamed == expected
    if cluster.connector == "pdserve":  # a stream says how its KV came, as a JSON answer does
        report, whole_report = kv_report(headers), kv_report(whole_headers)
        assert report["source"] == "transfer" and report["bytes"] == whole_report["bytes"], (report, whole_report)


def test_bad_requests_get_openai_errors(cluster: Cluster) -> None:
    status, _, body = http_json(cluster.proxy_url + "/v1/chat/completions", chat("hi", model="gpt-4"))
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, _, body = http_json(cluster.proxy_url + "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert status == 400 and body["error"]["param"] == "messages"
    # A prompt longer than the context is the engine's 400, passed through with its words.
    status, _, body = http_json(cluster.proxy_url + "/v1/completions", {"model": MODEL, "prompt": "hi " * 5000})
    assert status == 400 and "context" in body["error"]["message"].lower()
    status, _, body = http_json(cluster.proxy_url + "/v1/models")
    adapters = [ADAPTER] if cluster.connector == "pdserve" else []  # the pdserve cluster's LoRA adapter
    assert status == 200 and [m["id"] for m in body["data"]] == [MODEL, *adapters]


@pytest.mark.teardown_check
def test_down_leaves_no_process_behind(cluster: Cluster) -> None:
    status = serving(cluster)
    recorded = json.loads((Path(cluster.env["PDSERVE_STATE_DIR"]) / "cluster.json").read_text())
    ours = [psutil.Process(e["pid"]) for e in status["engines"]]
    ours += [child for proc in list(ours) for child in proc.children(recursive=True)]
    names = [(p.pid, p.name(), " ".join(p.cmdline())[:80]) for p in ours]
    # vLLM's engine core: titled VLLM::EngineCore by setproctitle, else still the multiprocessing child it is
    # (once, 2026-11-27, a vllm-nixl cluster's engine core kept "python3 -c ... spawn_main": the same pid its
    # log names, setproctitle installed; the title is cosmetic, the process is what must go).
    assert any("EngineCore" in name + cmdline or "multiprocessing.spawn" in cmdline for _, name, cmdline in names), (
        f"engine cores not found in {names}"
    )
    in_shm = shm.mapped(p.pid for p in ours)
    assert in_shm, "the engines hold nothing in /dev/shm: the check below would check nothing"
    # vLLM's sockets and Gloo files: in each engine's private temp dir (its processes' TMPDIR), not in /tmp
    temp_dirs = {Path(p.environ()["TMPDIR"]) for p in ours if "TMPDIR" in p.environ()}
    assert len(temp_dirs) == len(status["engines"]), temp_dirs
    for temp_dir in temp_dirs:
        assert temp_dir.stat().st_mode & 0o777 == 0o700 and any(temp_dir.iterdir()), temp_dir
    ray_home = Path(recorded["ray_temp_dir"]).parent
    assert ray_home.stat().st_mode & 0o777 == 0o700, oct(ray_home.stat().st_mode)
    result = cluster.down()
    assert result.returncode == 0, result.stderr
    assert "stopped cluster 'pdserve-test'" in result.stdout
    assert [p.pid for p in ours if _alive(p)] == []
    assert [str(f) for f in in_shm if f.exists()] == []  # vLLM's queues and regions went with the engines
    ray_processes = [
        p.pid for p in psutil.process_iter(["cmdline"]) if recorded["ray_temp_dir"] in " ".join(p.info["cmdline"] or [])
    ]
    assert ray_processes == []
    assert [str(d) for d in (*temp_dirs, ray_home) if d.exists()] == []
    for port in (18000, 18100, 18200):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still answers"
    assert run_pdserve("status", env=cluster.env).returncode == 3  # nothing is recorded as running


def serving(cluster: Cluster, timeout_s: float = 180) -> dict:
    """The status once every engine is ready and its process known. A controller that Ray restarted knows an
    engine's pid only once it adopted the engine (its API answers before): without this wait the check above
    would look for the engine cores among the children of pytest (``psutil.Process(None)``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = cluster.refresh()
        engines = [(e["engine_id"], e["state"], e["pid"], e["restarts"]) for e in status["engines"]]
        if engines and all(state == "ready" and pid for _, state, pid, _ in engines):
            return status
        if time.monotonic() > deadline:
            events = [e["message"] for e in status["events"][-8:]]
            raise AssertionError(f"engines not serving after {timeout_s:g}s: {engines}; last events: {events}")
        time.sleep(1)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "monitoring" / "grafana-dashboard.json"
_QUERIED = re.compile(r"\b(pdserve_proxy_\w+|pdserve:\w+|vllm:\w+)")
_SAMPLE_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def _family(name: str) -> str:
    for suffix in _SAMPLE_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def _families(url: str) -> set[str]:
    """The metric families ``url``/metrics declares (``# TYPE``) or has samples of: a labelled counter
    nothing has counted yet still declares itself."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(_family(line.split()[2]))
        elif line and not line.startswith("#"):
            names.add(_family(re.split(r"[{ ]", line, maxsplit=1)[0]))
    return names


@pytest.mark.parametrize("cluster", ["pdserve"], indirect=True)
def test_every_metric_the_grafana_dashboard_queries_exists_on_the_running_cluster(cluster: Cluster) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {
        _family(name)
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        for name in _QUERIED.findall(target["expr"])
    }
    served = _families(cluster.proxy_url)
    for role in ("prefill", "decode"):
        served |= _families(cluster.engine(role)["url"])  # an engine's /metrics needs no key (Prometheus's)

    assert queried >= {"pdserve_proxy_requests", "vllm:kv_cache_usage_perc", "pdserve:kv_transfer_bytes"}
    assert queried - served == set()
