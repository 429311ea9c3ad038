"""The KV tier on real engines: a conversation's next turn loads its history from the node tier, or
the shared one, after the engines restart, answers exactly as without the tier, and a corrupted entry
on disk never changes an answer. The proxy routes by what the tier holds: a prompt it never saw, whose
history the tier holds, is served decode-only.

Two clusters of their own, one after the other, sharing one tier directory and one cluster secret
(the tier's MAC key is derived from it; ``pdserve up`` takes the secret file it is given): the second
is the first "restarted" (new engines, empty host memory, empty prefix caches), so what it does not
compute it can only have loaded from the directory. The answer "without the tier" is the same request with a
``cache_salt``: its block hashes differ, so nothing stored matches and the engines compute it all.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import urllib.request
from pathlib import Path

import pytest
import yaml

from connectors import wire
from connectors.auth import SECRET_FILE_ENV, ClusterSecret, new_secret, tier_key, write_secret
from connectors.tier.store import HEADER, read_entry
from orchestrator.shm import SHM_DIR
from tests.integration.conftest import HERE, engine_headers, http_json, own_cluster

pytestmark = [pytest.mark.integration, pytest.mark.after_cluster]

MODEL = "smollm2-135m-instruct"
LONG_FOLLOW_UP = (
    "Now tell me everything the keepers might have written on the stormiest night of the year, hour by hour, "
    "with the ships, the wind and the lamp. " * 6
)
"""A new message long enough that the stored history is under 80 % of the prompt: not served decode-only."""
STORY = (
    "The keepers of the northern lighthouse wrote in their log every evening: the wind, the height of "
    "the sea, the ships that passed and how much oil the lamp had burnt. "
)


def spec(tier_dir: Path, name: str, **proxy: object) -> dict:
    base = yaml.safe_load((HERE / "cluster.yaml").read_text())
    return base | {
        "name": name,
        "connector": "pdserve",
        "proxy": {"port": 18600, **proxy},
        "prefill": base["prefill"] | {"port": 18700, "kv_port": 16000},
        "decode": base["decode"] | {"port": 18800, "kv_port": 16100},
        "kv_tier": {"host_gib": 0.25, "node_gib": 0.5, "shared_gib": 1, "shared_path": str(tier_dir)},
    }


def request(messages: list[dict], salt: str | None = None) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    return body


def ask(proxy_url: str, messages: list[dict], salt: str | None = None) -> tuple[int, dict, dict]:
    """Status, headers (names in lower case) and answer of a chat request through the proxy."""
    code, headers, answer = http_json(proxy_url + "/v1/chat/completions", request(messages, salt), timeout=300)
    return code, {name.lower(): value for name, value in headers.items()}, answer


def chat(proxy_url: str, messages: list[dict], salt: str | None = None) -> str:
    status, _, answer = ask(proxy_url, messages, salt)
    assert status == 200, answer
    return answer["choices"][0]["message"]["content"]


def tier_held(engine_url: str, messages: list[dict], headers: dict[str, str], salt: str | None = None) -> dict:
    """What the engine says its tiers hold of this chat's prompt."""
    code, _, answer = http_json(
        engine_url + wire.TIER_HELD_PATH + "?kind=chat", request(messages, salt), headers=headers
    )
    assert code == 200, answer
    return answer


def metrics(url: str, headers: dict[str, str]) -> dict[str, float]:
    """An engine's counters, ``name{labels}`` -> value."""
    request = urllib.request.Request(url + "/metrics", headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def total(values: dict[str, float], name: str, **labels: str) -> float:
    """The sum of a counter over its series whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for key, v in values.items() if key.startswith(name + "{") and all(w in key for w in want))


def intact(entry: Path, tier: Path, secret: ClusterSecret) -> bool:
    """Whether the entry reads back whole and MAC'd under the cluster's tier key (its name: its path in the
    tier directory, namespace first, as ``EntryStore.name_of`` says)."""
    out = memoryview(bytearray(entry.stat().st_size - HEADER.size))
    try:
        read_entry(entry, out, key=tier_key(secret), name=entry.relative_to(tier).as_posix())
    except OSError:
        return False
    return True


def conversation(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"A question about {topic}. " + STORY * 18 + f"Tell me about {topic}."}]


def test_history_comes_from_the_tiers_after_a_restart_and_answers_do_not_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"pdserve-kv-tier-{secrets.token_hex(3)}"
    tier, node = tmp_path / "tier", Path("/dev/shm/pdserve-kv") / name
    secret = new_secret()  # both clusters': the second accepts the entries the first stored
    write_secret(tmp_path / "cluster-secret", secret)
    monkeypatch.setenv(SECRET_FILE_ENV, str(tmp_path / "cluster-secret"))
    try:
        check_tiers(tmp_path, name, tier, node, secret)
    finally:
        shutil.rmtree(node, ignore_errors=True)  # the node tier outlives the cluster by design
        with contextlib.suppress(OSError):
            node.parent.rmdir()  # when no other cluster's node tier is in it


def check_tiers(tmp_path: Path, name: str, tier: Path, node: Path, secret: ClusterSecret) -> None:
    regions_before = set(SHM_DIR.glob("vllm_offload_*"))
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
    first, second = conversation("the wind"), conversation("the oil")
    with own_cluster(tmp_path / "a", spec(tier, name)) as status:
        url = status["proxy_url"]
        for talk, follow_up in ((first, "And then?"), (second, LONG_FOLLOW_UP)):
            talk += [{"role": "assistant", "content": chat(url, talk)}, {"role": "user", "content": follow_up}]
        expected = [chat(url, talk, salt="no-tier") for talk in (first, second)]  # computed whole
    assert sorted(tier.rglob("*.bin")), "the first cluster stored nothing in the shared tier"
    assert sorted(node.rglob("*.bin")), "the first cluster stored nothing in the node tier"

    # The second cluster's proxy serves decode-only a prompt the tier holds (80 % of its tokens by default).
    with own_cluster(tmp_path / "b", spec(tier, name, decode_only_if_cached=True)) as status:
        url, headers = status["proxy_url"], engine_headers(status["state_dir"])
        prefill = next(e["url"] for e in status["engines"] if e["role"] == "prefill")
        decode = next(e["url"] for e in status["engines"] if e["role"] == "decode")
        # each engine's host tier region is named for this start, not by its engine id alone
        regions = {path.name for path in set(SHM_DIR.glob("vllm_offload_*")) - regions_before}
        assert len(regions) == 2 and not regions & {"vllm_offload_prefill-0.mmap", "vllm_offload_decode-0.mmap"}

        # 1. An engine says how much of a prompt the tiers hold: whole 128-token blocks of the stored history,
        #    not the new turn; nothing for the same prompt with another cache_salt; and only to the cluster.
        held = tier_held(decode, first, headers)
        assert held[wire.TIERS][wire.SHARED_TIER] >= 4 * 128 and held[wire.TIERS][wire.SHARED_TIER] % 128 == 0
        assert held[wire.TIERS][wire.SHARED_TIER] < held[wire.PROMPT_TOKENS] and held[wire.TIERS]["node"] >= 4 * 128
        assert tier_held(decode, first, headers, salt="other")[wire.TIERS] == {wire.SHARED_TIER: 0, "node": 0}
        assert http_json(decode + wire.TIER_HELD_PATH + "?kind=chat", {"messages": first})[0] == 401

        # 2. The next turn of a conversation this proxy never saw, whose history the tier holds: the proxy
        #    asks the tier and serves it on the decode engine alone, which loads the history from the node
        #    tier (looked up before the shared one). The answer is the same.
        code, reply_headers, answer = ask(url, first)
        assert code == 200, answer
        assert reply_headers["x-pdserve-path"] == "decode-only; reason=cached"
        assert answer["choices"][0]["message"]["content"] == expected[0]
        assert answer["usage"]["prompt_tokens"] == held[wire.PROMPT_TOKENS]  # the engine counted it as vLLM does
        on_decode = metrics(decode, headers)
        assert total(on_decode, "vllm:prompt_tokens_cached_by_source_total", source="disk") >= 4 * 128
        assert total(on_decode, "pdserve:kv_tier_hits_total", tier="node") >= 4
        assert total(metrics(url, {}), "pdserve_proxy_tier_lookups_total", outcome="ok") >= 1

        # 3. The node tier lost (the engines run on another host now), and a turn whose new message is long:
        #    disaggregated, its prefill engine loads the history from the shared tier and computes the rest.
        for entry in node.rglob("*.bin"):
            entry.unlink()
        code, reply_headers, answer = ask(url, second)
        assert code == 200, answer
        assert reply_headers["x-pdserve-path"] == "disaggregated"
        assert answer["choices"][0]["message"]["content"] == expected[1]
        after = metrics(prefill, headers)
        from_disk = total(after, "vllm:prompt_tokens_cached_by_source_total", source="disk")
        assert from_disk >= 4 * 128, json.dumps({k: v for k, v in after.items() if "by_source" in k}, indent=1)
        # the prefill engine loads KV from nothing but the tier: its external tokens are the tier's
        assert total(after, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") >= 4 * 128
        assert total(after, "pdserve:kv_tier_hits_total", tier="shared") >= 4
        assert total(after, "pdserve:kv_tier_load_bytes_total", tier="shared") > 0

        # 4. Every entry on disk corrupted (one flipped byte each): the prefill engine, asked directly for
        #    the turn it never saw (the proxy would send it to the decode engine, which holds it), finds
        #    them, drops them, computes the history again and answers exactly as before.
        for entry in tier.rglob("*.bin"):
            data = bytearray(entry.read_bytes())
            data[len(data) // 2] ^= 0x5A
            entry.write_bytes(bytes(data))
        code, _, answer = http_json(prefill + "/v1/chat/completions", request(first), timeout=300, headers=headers)
        assert code == 200, answer
        assert answer["choices"][0]["message"]["content"] == expected[0]
        after = metrics(prefill, headers)
        assert total(after, "pdserve:kv_tier_corrupt_entries_total", tier="shared") >= 1
        # ... and stored again: its blocks' entries on disk read back intact.
        assert sum(intact(entry, tier, secret) for entry in tier.rglob("*.bin")) >= 4
    # the engines took their host regions (host_gib each in /dev/shm) with them
    assert set(SHM_DIR.glob("vllm_offload_*")) - regions_before == set()
