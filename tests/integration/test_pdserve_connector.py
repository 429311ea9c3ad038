"""Our own connector (``connector: pdserve``) end to end: real Ray, real vLLM CPU engines, real NIXL.

A cluster of its own (its spec in tmp_path, its own state directory), started
after the shared cluster is stopped: the machine has cores for one cluster.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import UP_TIMEOUT_S, http_json, metric_values, run_pdserve

pytestmark = [pytest.mark.integration, pytest.mark.after_cluster]

MODEL = "smollm2-135m-instruct"
SOURCE_METRIC = "vllm:prompt_tokens_by_source_total"
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 plus 30?",
    "What do bees make?",
]
SPEC = {
    "name": "pdserve-conn",
    "model": MODEL,
    "device": "cpu",
    "connector": "pdserve",
    "proxy": {"port": 21000},
    "prefill": {"replicas": 1, "cpu_cores": 1, "port": 21100, "kv_port": 17600},
    "decode": {"replicas": 1, "cpu_cores": 1, "port": 21200, "kv_port": 17700},
    "engine": {"max_model_len": 4096, "kv_cache_gib": 1},
}


def chat(prompt: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], **extra}


@pytest.fixture(scope="module")
def pdserve_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """``pdserve up --detach`` on the pdserve-connector spec; ``pdserve down`` always follows."""
    root = tmp_path_factory.mktemp("pdserve-connector")
    env = dict(os.environ, PDSERVE_STATE_DIR=str(root / "state"))
    env.pop("RAY_ADDRESS", None)
    spec_path = root / "cluster.yaml"
    spec_path.write_text(yaml.safe_dump(SPEC))
    try:
        up = run_pdserve("up", str(spec_path), "--detach", env=env, timeout=UP_TIMEOUT_S)
        if up.returncode != 0:
            pytest.fail(f"pdserve up failed ({up.returncode}):\n{up.stdout}\n{up.stderr}")
        status = run_pdserve("status", "--json", env=env)
        assert status.returncode == 0, status.stderr
        yield json.loads(status.stdout)
    finally:
        down = run_pdserve("down", env=env, timeout=300)
        assert down.returncode == 0, down.stderr


def engine_url(status: dict, role: str) -> str:
    return next(e["url"] for e in status["engines"] if e["role"] == role)


def test_the_answer_comes_through_our_connector(pdserve_cluster: dict) -> None:
    status, headers, body = http_json(
        pdserve_cluster["proxy_url"] + "/v1/chat/completions",
        chat("What is the capital of France?", temperature=0, max_tokens=32),
    )

    assert status == 200, body
    assert "Paris" in body["choices"][0]["message"]["content"]
    headers = {name.lower(): value for name, value in headers.items()}
    assert (headers["x-pdserve-prefill"], headers["x-pdserve-decode"]) == ("prefill-0", "decode-0")


def test_decode_computes_no_prompt_token_and_answers_like_the_prefill_engine(pdserve_cluster: dict) -> None:
    """Greedy output through the proxy equals the prefill engine's own answer, and every prompt
    token on the decode engine came over our connector."""
    decode_url = engine_url(pdserve_cluster, "decode")
    prefill_url = engine_url(pdserve_cluster, "prefill")
    before = metric_values(decode_url, SOURCE_METRIC, "source")
    prompt_tokens = 0
    for prompt in PROMPTS:
        request = chat(prompt, temperature=0, max_tokens=32)
        status, _, alone = http_json(prefill_url + "/v1/chat/completions", request)
        assert status == 200, alone
        status, _, disaggregated = http_json(pdserve_cluster["proxy_url"] + "/v1/chat/completions", request)
        assert status == 200, disaggregated
        assert disaggregated["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
        prompt_tokens += disaggregated["usage"]["prompt_tokens"]
    after = metric_values(decode_url, SOURCE_METRIC, "source")

    assert after["external_kv_transfer"] - before.get("external_kv_transfer", 0) == prompt_tokens
    assert after["local_compute"] - before.get("local_compute", 0) == 0


def test_the_spec_selected_our_connector(pdserve_cluster: dict) -> None:
    log_dir = Path(pdserve_cluster["log_dir"])
    logs = "".join(path.read_text(errors="replace") for path in log_dir.glob("*.log"))

    assert "PdserveConnector" in logs
    assert "handshake side channel listening" in logs
