"""One real cluster (Ray, two vLLM CPU engines, NIXL, the proxy), shared by the suite.

The ``cluster`` fixture starts it the way a user does, with ``pdserve up
--detach`` in a private state directory, and stops it with ``pdserve down``
at the end of the session. It is parametrized over the KV connectors
(``CONNECTORS``): every test that uses it runs once against vLLM's
NixlConnector and once against ours, one cluster after the other. Tests marked ``teardown_check`` run last: they
stop the cluster themselves and check what is left; tests marked
``after_cluster`` run after those, on a machine with no cluster running
(the order is set in ``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from testlib.priority import run_ahead

HERE = Path(__file__).parent
PDSERVE = [sys.executable, "-m", "orchestrator.cli"]
UP_TIMEOUT_S = 900
CONNECTORS = ("vllm-nixl", "pdserve")


# Generous: on these machines the page cache is reclaimed hard (kdamond), and a CLI call that
# imports Ray was seen taking 160-200 s after an engine restart (process in D state, reading files).
CLI_TIMEOUT_S = 900


def run_pdserve(
    *args: str, env: dict[str, str], timeout: float = CLI_TIMEOUT_S, ahead: bool = False
) -> subprocess.CompletedProcess:
    """``pdserve ARGS``; ``ahead``: in a session of its own, ahead of the engines on the CPU (``run_ahead``), for a
    command whose client clock measures the engines (``pdserve profile``)."""
    return subprocess.run(
        [*PDSERVE, *args], env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
        start_new_session=ahead, preexec_fn=run_ahead if ahead else None,
    )  # fmt: skip


ADAPTER = "smollm2-random-lora"
"""The LoRA adapter of the shared pdserve cluster: random weights (``testlib.lora``), so its answers differ."""


@dataclass
class Cluster:
    env: dict[str, str]
    status: dict
    up_output: str
    connector: str = "vllm-nixl"
    stopped: bool = field(default=False)

    @property
    def proxy_url(self) -> str:
        return self.status["proxy_url"]

    @property
    def engine_headers(self) -> dict[str, str]:
        return engine_headers(self.env["PDSERVE_STATE_DIR"])

    def engine(self, role: str) -> dict:
        return next(e for e in self.status["engines"] if e["role"] == role)

    def refresh(self) -> dict:
        result = run_pdserve("status", "--json", env=self.env)
        assert result.returncode == 0, result.stderr
        self.status = json.loads(result.stdout)
        return self.status

    def down(self) -> subprocess.CompletedProcess:
        self.stopped = True
        return run_pdserve("down", env=self.env)


@pytest.fixture(scope="session")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pdserve-state")


@pytest.fixture(scope="session")
def pdserve_env(state_dir: Path) -> dict[str, str]:
    env = dict(os.environ, PDSERVE_STATE_DIR=str(state_dir))
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.fixture(scope="session", params=CONNECTORS)
def cluster(request: pytest.FixtureRequest, pdserve_env: dict[str, str], state_dir: Path) -> Cluster:
    connector = request.param
    spec = yaml.safe_load((HERE / "cluster.yaml").read_text()) | {"connector": connector}
    if connector == "pdserve":  # a LoRA adapter both pools load (test_parity.py)
        from orchestrator.models import resolve_model
        from testlib.lora import make_adapter

        adapter = make_adapter(resolve_model(spec["model"]), state_dir / "adapters" / ADAPTER)
        spec["engine"]["lora_adapters"] = {ADAPTER: str(adapter)}
    spec_path = state_dir / f"cluster-{connector}.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    result = run_pdserve("up", str(spec_path), "--detach", env=pdserve_env, timeout=UP_TIMEOUT_S)
    if result.returncode != 0:
        run_pdserve("down", env=pdserve_env)
        pytest.fail(f"pdserve up failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    running = Cluster(env=pdserve_env, status={}, up_output=result.stdout, connector=connector)
    running.refresh()
    yield running
    if not running.stopped:
        running.down()


# The GCS notices a lost host after period x threshold (Ray's defaults: 3 s x 5, ~12 s here).
FAST_HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
THREE_HOSTS = ("head", "prefill", "decode")


@pytest.fixture(scope="session")
def three_hosts() -> Iterator[dict]:
    """The multi-host test bed (testlib/testbed): head, prefill and decode namespace hosts, a Ray node
    each; shared by the tests that use it (they run last, ``tests/conftest.py``), always torn down."""
    from testlib import testbed as hosts

    try:
        yield hosts.up(THREE_HOSTS, ray_env=FAST_HEALTH_CHECKS, fresh=True, timeout_s=180)
    finally:
        hosts.down()
    assert not hosts.namespaces()


@contextlib.contextmanager
def own_cluster(root: Path, spec: dict) -> Iterator[dict]:
    """A cluster of a test module's own: ``pdserve up --detach`` on ``spec`` in a private
    state directory under ``root``; yields ``pdserve status --json``; ``pdserve down`` always follows."""
    env = dict(os.environ, PDSERVE_STATE_DIR=str(root / "state"))
    env.pop("RAY_ADDRESS", None)
    spec_path = root / "cluster.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    try:
        up = run_pdserve("up", str(spec_path), "--detach", env=env, timeout=UP_TIMEOUT_S)
        if up.returncode != 0:
            pytest.fail(f"pdserve up failed ({up.returncode}):\n{up.stdout}\n{up.stderr}")
        status = run_pdserve("status", "--json", env=env)
        assert status.returncode == 0, status.stderr
        yield json.loads(status.stdout) | {"state_dir": str(root / "state")}
    finally:
        down = run_pdserve("down", env=env)
        assert down.returncode == 0, down.stderr


def engine_headers(state_dir: str | Path) -> dict[str, str]:
    """What a caller of a cluster's engines must send: the engine key derived from the cluster's secret,
    which ``pdserve up`` left in its state directory (only the proxy and tests call engines)."""
    from contract.auth import engine_key, read_secret_file

    return {"Authorization": f"Bearer {engine_key(read_secret_file(Path(state_dir) / 'cluster-secret'))}"}


def http_json(
    url: str, body: dict | None = None, timeout: float = 120, headers: dict[str, str] | None = None
) -> tuple[int, dict, dict]:
    """POST ``body`` (or GET when None); return (status, headers, parsed JSON)."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def http_stream(url: str, body: dict, timeout: float = 120, headers: dict[str, str] | None = None) -> list[dict]:
    """POST a streaming request; return the parsed SSE events up to [DONE] (and put the response's
    headers, names lower-cased, into ``headers``)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(request, timeout=timeout) as response:
        if headers is not None:
            headers.update({name.lower(): value for name, value in response.headers.items()})
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return events
            events.append(json.loads(line[len("data: ") :]))
    raise AssertionError("stream ended without data: [DONE]")


def kv_report(headers: dict[str, str]) -> dict[str, str]:
    """The ``X-PDServe-KV`` header as a dict: ``{"source": "transfer", "bytes": "...", ...}``."""
    value = {name.lower(): v for name, v in headers.items()}["x-pdserve-kv"]
    return dict(item.split("=", 1) for item in value.split("; "))


def metric_values(base_url: str, name: str, label: str) -> dict[str, float]:
    """Values of a Prometheus counter on an engine's /metrics, keyed by one label."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].rsplit("} ", 1)
            for pair in labels.split(","):
                key, _, quoted = pair.partition("=")
                if key == label:
                    values[quoted.strip('"')] = float(value)
    return values
