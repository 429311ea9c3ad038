"""A READ never uses blocks that may have been freed: short leases, engines short of KV blocks, concurrent load.

The prefill engine keeps a request's blocks under a lease (2 s here) and then gives them to the next
request; a decode engine that waits for blocks of its own (4 blocks of 128 tokens, two requests at a time)
would, without the READ window, read blocks that by then hold another prompt's KV, and answer from it with
200. With it (``read_margin_s``: a READ must be over 1.75 s before the lease ends, so one that waits more
than 0.25 s for a decode slot is late on any machine; with a margin of 1 s, a fast machine read every KV in
time) every late read is recomputed: every greedy answer equals the same prompt computed by one engine
alone, and the expired reads show as ``X-PDServe-KV: source=recomputed; reason=expired`` and in
``pdserve:kv_transfer_failures_total{kind="expired"}``; and every lease the burst took ends (read, released or
expired): no blocks stay held. Its own cluster, after the shared one.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import pytest

from tests.integration.conftest import engine_headers, http_json, kv_report, metric_values, own_cluster
from tests.integration.test_pdserve_connector import LEASES, PROMPTS, eventually, lease_deltas

pytestmark = [pytest.mark.integration, pytest.mark.after_cluster]

MODEL = "smollm2-135m-instruct"
LEASE_TTL_S = 2
SPEC = {
    "name": "pdserve-read-window",
    "model": MODEL,
    "device": "cpu",
    "connector": "pdserve",
    "connector_options": {"lease_ttl_s": LEASE_TTL_S, "read_margin_s": 1.75},
    "proxy": {"port": 22000},
    "prefill": {"replicas": 1, "cpu_cores": 1, "port": 22100, "kv_port": 18600},
    "decode": {"replicas": 1, "cpu_cores": 1, "port": 22200, "kv_port": 18700},
    # float32: the same greedy answer whatever the batch (bf16 sums differ with the batch's shape);
    # 5 blocks of 128 tokens (vLLM keeps one): two requests of ~160 prompt and 64 output tokens at a time, the
    # others wait
    "engine": {"max_model_len": 384, "kv_cache_gib": 1, "dtype": "float32",
               "extra_args": {"num_gpu_blocks_override": 5}},
}  # fmt: skip
# Long enough that a request waits for a decode slot past its READ window on a fast machine too.
MAX_TOKENS = 64
FILLER = "Here is some context about the town, its river, its bridges, its market and its people. " * 6
QUESTIONS = [
    *PROMPTS,
    "What is the largest ocean?",
    "What gas do plants breathe in?",
    "How many days are in a week?",
    "What is frozen water called?",
]


def chat(question: str) -> dict:
    content = f"{FILLER}\n{question}"
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    }


@pytest.fixture(scope="module")
def window_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    with own_cluster(tmp_path_factory.mktemp("read-window"), SPEC) as status:
        yield status


def url_of(status: dict, role: str) -> str:
    return next(e["url"] for e in status["engines"] if e["role"] == role)


def test_reads_that_would_outlive_the_lease_are_recomputed_never_served(window_cluster: dict) -> None:
    decode_url, prefill_url = url_of(window_cluster, "decode"), url_of(window_cluster, "prefill")
    alone = {}
    for question in QUESTIONS:  # one engine, one request at a time: the answers to match
        status, _, answer = http_json(
            prefill_url + "/v1/chat/completions", chat(question), headers=engine_headers(window_cluster["state_dir"])
        )
        assert status == 200, answer
        alone[question] = answer["choices"][0]["message"]["content"]
    counted_before = metric_values(decode_url, "pdserve:kv_transfer_failures_total", "kind").get(
        "expired", 0
    ) + metric_values(decode_url, "pdserve:kv_refused_total", "kind").get("params", 0)
    leases_before = metric_values(prefill_url, LEASES, "outcome")

    def disaggregated(question: str) -> tuple[str, str, dict]:
        status, headers, answer = http_json(window_cluster["proxy_url"] + "/v1/chat/completions", chat(question))
        assert status == 200, answer
        return question, answer["choices"][0]["message"]["content"], kv_report(headers)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(disaggregated, QUESTIONS * 2))

    for question, content, report in results:
        assert content == alone[question], (question, report)
    sources = [(report["source"], report.get("reason")) for _, _, report in results]
    expired = sources.count(("recomputed", "expired"))
    assert expired > 0, sources  # the window closed on some reads: they were recomputed
    assert all(source in ("transfer", "local_prefix_cache") or reason == "expired" for source, reason in sources), (
        sources
    )
    # counted: refused when they arrived already expired, failed when the READ could not end in time

    def counted() -> float:
        failed = metric_values(decode_url, "pdserve:kv_transfer_failures_total", "kind").get("expired", 0)
        refused = metric_values(decode_url, "pdserve:kv_refused_total", "kind").get("params", 0)
        return failed + refused - counted_before

    assert eventually(counted, expired, timeout_s=20) == expired
    # and every lease ended: read, released by the decode engine when its read was late, or expired; none
    # holds blocks. Which of the last two a late read gives depends on the machine's speed (on a fast one the
    # decode engine released each in time); expiry alone is test_pdserve_connector's
    # test_blocks_nobody_reads_are_freed_when_the_lease_expires.
    assert eventually(
        lambda: sum(lease_deltas(prefill_url, leases_before).values()), len(results), timeout_s=20
    ) == len(results)
