"""A cluster of two models behind one proxy, on real vLLM CPU engines: the demo model and the tiny test model,
one prefill and one decode engine each (``ClusterSpec.models``); the tiny model's decode engine runs TP 2.

Each model's requests go to its own engines, through P/D with the KV moved, and answer as that model's decode
engine alone does; a model nobody serves is a 404 in OpenAI's format naming both; ``/v1/models`` lists both; the
proxy's metrics and ``pdserve status`` name the model; ``pdserve scale`` asks which model a change is for. KV never
moves between the models: transfer parameters of one model's prefill engine, handed to the other model's decode
engine, are refused by the connector's compatibility check and the decode engine computes the prompt itself.
Prefill TP 1 -> decode TP 2 through our connector: the tiny test model (random weights, 2 KV heads;
``scripts/make_tiny_model.py``) runs on a prefill engine of one rank and a decode engine of two: each decode rank
reads its own KV head from the single prefill rank. Greedy output through the proxy must equal the decode
engine's own, for prompts the decode engine never computed (its prefix caching is off, so nothing is served
from its cache), and the decode engine's metrics must show every prompt token arrived over the connector.
Five engine processes share this machine's two cores (``resources.share_cores``), so this cluster starts after
the shared one.
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.launch import plan_engines
from orchestrator.spec import ClusterSpec
from proxy.apis.completions import Completions
from proxy.bodies import decode_body
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

DEMO, TINY = "smollm2-135m-instruct", "tiny-llama-random"
SPEC = {
    "name": "pdserve-models",
    "device": "cpu",
    "connector": "pdserve",
    "proxy": {"port": 22500},
    "resources": {"cpus": 2, "share_cores": True},
    "models": [
        {
            "model": DEMO,
            "prefill": {"port": 22510, "kv_port": 18810},
            "decode": {"port": 22520, "kv_port": 18820},
            "engine": {"max_model_len": 1024},
        },
        {
            "model": TINY,
            "key": "tiny",
            "prefill": {"port": 22530, "kv_port": 18830},
            "decode": {"port": 22540, "kv_port": 18840, "tensor_parallel_size": 2},
            "engine": {"max_model_len": 1024, "extra_args": {"enable_prefix_caching": False}},
        },
    ],
}
PROMPT = "Paris is the capital of France, and Rome is the capital of"
TP_PROMPTS = [
    "The quick brown fox",
    "Prefill engines compute the prompt and",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 " * 12,  # a few blocks' worth of tokens
    "decode engines generate the answer. " * 30,
]
SOURCE_METRIC = "vllm:prompt_tokens_by_source_total"


@pytest.fixture(scope="module")
def models_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    with own_cluster(tmp_path_factory.mktemp("pdserve-models"), SPEC) as status:
        yield status


def completion(model: str, prompt: str = PROMPT) -> dict:
    return {"model": model, "prompt": prompt, "temperature": 0, "max_tokens": 8, "ignore_eos": True}


def engine_url(status: dict, engine_id: str) -> str:
    return next(e["url"] for e in status["engines"] if e["engine_id"] == engine_id)


@pytest.mark.parametrize(("model", "key"), [(DEMO, DEMO), (TINY, "tiny")])
def test_each_model_is_served_by_its_own_engines_with_its_kv_moved(models_cluster: dict, model: str, key: str) -> None:
    alone_status, _, alone = http_json(
        engine_url(models_cluster, f"{key}-decode-0") + "/v1/completions",
        completion(model),
        headers=engine_headers(models_cluster["state_dir"]),
    )
    assert alone_status == 200, alone

    status, headers, body = http_json(models_cluster["proxy_url"] + "/v1/completions", completion(model))

    assert status == 200, body
    named = {name.lower(): value for name, value in headers.items()}
    assert (named["x-pdserve-prefill"], named["x-pdserve-decode"]) == (f"{key}-prefill-0", f"{key}-decode-0")
    report = kv_report(headers)
    assert report["source"] == "transfer" and int(report["bytes"]) > 0, report
    assert body["model"] == model
    assert body["choices"][0]["text"] == alone["choices"][0]["text"]
    assert body["usage"] == alone["usage"]


def test_one_endpoint_lists_both_models_and_refuses_another(models_cluster: dict) -> None:
    proxy = models_cluster["proxy_url"]
    status, _, listing = http_json(proxy + "/v1/models")
    assert status == 200 and [m["id"] for m in listing["data"]] == [DEMO, TINY]

    status, _, refused = http_json(proxy + "/v1/completions", completion("gpt-4o"))

    assert status == 404
    assert refused["error"]["code"] == "model_not_found" and refused["error"]["param"] == "model"
    assert f"`{DEMO}`" in refused["error"]["message"] and f"`{TINY}`" in refused["error"]["message"]
    status, _, health = http_json(proxy + "/health")
    assert status == 200 and health["models"] == {DEMO: "ok", TINY: "ok"}


def test_metrics_and_status_name_the_model(models_cluster: dict) -> None:
    assert http_json(models_cluster["proxy_url"] + "/v1/completions", completion(TINY))[0] == 200
    with urllib.request.urlopen(models_cluster["proxy_url"] + "/metrics", timeout=30) as response:
        page = response.read().decode()
    assert f'pdserve_proxy_requests_received_total{{model="{TINY}"}}' in page
    assert f'pdserve_proxy_pool_engines{{model="{DEMO}",role="decode",state="ready"}} 1.0' in page

    env = dict(os.environ, PDSERVE_STATE_DIR=str(Path(models_cluster["state_dir"])))
    env.pop("RAY_ADDRESS", None)
    shown = json.loads(run_pdserve("status", "--json", env=env).stdout)
    assert [(m["name"], m["key"], m["pools"]["decode"]["ready"]) for m in shown["models"]] == [
        (DEMO, DEMO, 1),
        (TINY, "tiny", 1),
    ]
    assert {e["engine_id"]: e["model"] for e in shown["engines"]}["tiny-decode-0"] == TINY
    assert shown["pools"]["decode"]["ready"] == 2  # both models'

    unnamed = run_pdserve("scale", "decode=1", env=env)
    assert unnamed.returncode != 0 and f"one of {DEMO}, {TINY}" in unnamed.stderr, unnamed.stderr
    named = run_pdserve("scale", "--model", "tiny", "decode=1", env=env)
    assert named.returncode == 0 and "tiny: prefill 1/1 ready, decode 1/1 ready" in named.stdout, named.stderr


def test_kv_of_one_model_is_never_loaded_by_the_others_engine(models_cluster: dict) -> None:
    headers = engine_headers(models_cluster["state_dir"])
    # The demo model's prefill engine computes the prompt for the tiny model's decode engine (as only a caller
    # with the engine key could ask): the transfer parameters are valid, bound to that reader.
    body = completion(DEMO)
    status, _, prefilled = http_json(
        engine_url(models_cluster, f"{DEMO}-prefill-0") + "/v1/completions",
        Completions().prefill_body(body, "tiny-decode-0"),
        headers=headers,
    )
    assert status == 200, prefilled
    params = prefilled["kv_transfer_params"]

    status, _, answer = http_json(
        engine_url(models_cluster, "tiny-decode-0") + "/v1/completions",
        decode_body(completion(TINY), params),
        headers=headers,
    )

    assert status == 200, answer
    kv = answer["kv_transfer_params"]["pdserve_kv"]
    assert (kv["source"], kv["reason"]) == ("recomputed", "incompatible"), kv
    assert "num_layers differs" in kv["detail"]


def test_the_engines_share_the_machines_cores_as_planned(models_cluster: dict) -> None:
    planned = {e.engine_id: e.cpu_bind for e in plan_engines(ClusterSpec.from_dict(SPEC))}
    assert {e["engine_id"]: e["cpu_bind"] for e in models_cluster["engines"]} == planned
    assert len(planned["tiny-decode-0"].split("|")) == 2  # a core for each of its two ranks
    assert all(e["state"] == "ready" for e in models_cluster["engines"])


def test_tp1_prefill_to_tp2_decode_gives_the_decode_engines_own_greedy_output(models_cluster: dict) -> None:
    decode_url, proxy_url = engine_url(models_cluster, "tiny-decode-0"), models_cluster["proxy_url"]
    alone = {}
    for prompt in TP_PROMPTS:
        status, _, body = http_json(
            decode_url + "/v1/completions",
            completion(TINY, prompt),
            headers=engine_headers(models_cluster["state_dir"]),
        )
        assert status == 200, body
        alone[prompt] = body

    before = metric_values(decode_url, SOURCE_METRIC, "source")
    prompt_tokens = 0
    for prompt in TP_PROMPTS:
        status, headers, body = http_json(proxy_url + "/v1/completions", completion(TINY, prompt))
        assert status == 200, body
        assert body["choices"][0]["text"] == alone[prompt]["choices"][0]["text"], prompt
        assert body["usage"] == alone[prompt]["usage"]
        report = kv_report(headers)
        assert report["source"] == "transfer" and int(report["bytes"]) > 0, report
        assert report["remote_engine_id"] == "tiny-prefill-0"
        # a stream's report comes from both decode ranks' side channels: the same bytes in all
        stream_headers: dict[str, str] = {}
        http_stream(proxy_url + "/v1/completions", completion(TINY, prompt) | {"stream": True}, headers=stream_headers)
        assert kv_report(stream_headers)["bytes"] == report["bytes"], (stream_headers, report)
        prompt_tokens += 2 * body["usage"]["prompt_tokens"]  # the stream's prompt came over the connector too
    after = metric_values(decode_url, SOURCE_METRIC, "source")

    assert after["external_kv_transfer"] - before["external_kv_transfer"] == prompt_tokens
    assert after["local_compute"] - before["local_compute"] == 0
