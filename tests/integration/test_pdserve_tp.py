"""Prefill TP 1 -> decode TP 2 through our connector, on real vLLM CPU engines.

The tiny test model (random weights, 2 KV heads; ``scripts/make_tiny_model.py``)
runs on a prefill engine of one rank and a decode engine of two: each decode
rank reads its own KV head from the single prefill rank. Greedy output through
the proxy must equal the decode engine's own, for prompts the decode engine
never computed (prefix caching is off, so nothing is served from its cache),
and the decode engine's metrics must show every prompt token arrived over the
connector. Three engine processes share this machine's two cores
(``resources.share_cores``), so this cluster starts after the shared one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.conftest import engine_headers, http_json, http_stream, kv_report, metric_values, own_cluster

pytestmark = [pytest.mark.integration, pytest.mark.after_cluster]

MODEL = "tiny-llama-random"
SPEC = {
    "name": "pdserve-tp",
    "model": MODEL,
    "device": "cpu",
    "connector": "pdserve",
    "proxy": {"port": 22000},
    "prefill": {"replicas": 1, "tensor_parallel_size": 1, "port": 22100, "kv_port": 18600},
    "decode": {"replicas": 1, "tensor_parallel_size": 2, "port": 22200, "kv_port": 18700},
    "resources": {"cpus": 2, "share_cores": True},
    "engine": {"max_model_len": 1024, "kv_cache_gib": 1, "extra_args": {"enable_prefix_caching": False}},
}
PROMPTS = [
    "The quick brown fox",
    "Prefill engines compute the prompt and",
    "Paris is the capital of France, and Rome is",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 " * 12,  # a few blocks' worth of tokens
    "KV cache blocks move between engines over",
    "decode engines generate the answer. " * 30,
]
SOURCE_METRIC = "vllm:prompt_tokens_by_source_total"


@pytest.fixture(scope="module")
def tp_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    with own_cluster(tmp_path_factory.mktemp("pdserve-tp"), SPEC) as status:
        yield status


def completion(prompt: str) -> dict:
    return {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 8, "ignore_eos": True}


def test_decode_ranks_share_the_machine_as_planned(tp_cluster: dict) -> None:
    binds = {e["engine_id"]: e["cpu_bind"] for e in tp_cluster["engines"]}
    assert binds == {"prefill-0": "0", "decode-0": "1|0"}
    assert all(e["state"] == "ready" for e in tp_cluster["engines"])


def test_tp1_prefill_to_tp2_decode_gives_the_decode_engines_own_greedy_output(tp_cluster: dict) -> None:
    decode_url = next(e["url"] for e in tp_cluster["engines"] if e["role"] == "decode")
    proxy_url = tp_cluster["proxy_url"]
    alone = {}
    for prompt in PROMPTS:
        status, _, body = http_json(
            decode_url + "/v1/completions", completion(prompt), headers=engine_headers(tp_cluster["state_dir"])
        )
        assert status == 200, body
        alone[prompt] = body

    before = metric_values(decode_url, SOURCE_METRIC, "source")
    prompt_tokens = 0
    for prompt in PROMPTS:
        status, headers, body = http_json(proxy_url + "/v1/completions", completion(prompt))
        assert status == 200, body
        assert body["choices"][0]["text"] == alone[prompt]["choices"][0]["text"], prompt
        assert body["usage"] == alone[prompt]["usage"]
        report = kv_report(headers)
        assert report["source"] == "transfer" and int(report["bytes"]) > 0, report
        assert report["remote_engine_id"] == "prefill-0"
        # a stream's report comes from both decode ranks' side channels: the same bytes in all
        stream_headers: dict[str, str] = {}
        http_stream(proxy_url + "/v1/completions", completion(prompt) | {"stream": True}, headers=stream_headers)
        assert kv_report(stream_headers)["bytes"] == report["bytes"], (stream_headers, report)
        prompt_tokens += body["usage"]["prompt_tokens"]  # the stream's prompt came over the connector too
        prompt_tokens += body["usage"]["prompt_tokens"]
    after = metric_values(decode_url, SOURCE_METRIC, "source")

    assert after["external_kv_transfer"] - before["external_kv_transfer"] == prompt_tokens
    assert after["local_compute"] - before["local_compute"] == 0
