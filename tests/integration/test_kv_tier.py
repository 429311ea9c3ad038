"""The KV tier on real engines: a conversation's next turn loads its history from the node tier, or
the shared one, after the engines restart, answers exactly as without the tier, and a corrupted entry
on disk never changes an answer. The proxy routes by what the tier holds: a prompt it never saw, whose
history the tier holds, is served decode-only.

Two clusters of their own, one after the other, sharing one tier directory, each with the cluster secret
its own ``pdserve up`` made (none is given: the tier's MAC key is the tier's own, kept in its directory,
``connectors.tier.key``): the second is the first "restarted" (new engines, empty host memory, empty
prefix caches), so what it does not compute it can only have loaded from the directory. The answer
"without the tier" is the same request with a ``cache_salt``: its block hashes differ, so nothing stored
matches and the engines compute it all. A last test takes one cluster down and brings it up again from
the same config, as a user would, and alters an entry between the two.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import stat
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from connectors.tier import TIER_HASH_ALGO
from connectors.tier.held import TierLayout, block_hashes
from connectors.tier.key import load_tier_key
from connectors.tier.store import HEADER, read_entry
from contract import wire
from contract.auth import SECRET_ENV, SECRET_FILE_ENV, read_secret_file
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
    code, _, answer = http_json(engine_url + wire.TIER_HELD_PATH, request(messages, salt), headers=headers)
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


def intact(entry: Path, tier: Path) -> bool:
    """Whether the entry reads back whole and MAC'd under the tier's key (its name: its path in the tier
    directory, namespace first, as ``EntryStore.name_of`` says). The test runs as the tier's owner, so it may
    read the key file: whoever can is whom the tier trusts."""
    out = memoryview(bytearray(entry.stat().st_size - HEADER.size))
    try:
        read_entry(entry, out, key=load_tier_key(tier).entry_key, name=entry.relative_to(tier).as_posix())
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
    for given in (SECRET_ENV, SECRET_FILE_ENV):  # each `pdserve up` makes a secret of its own
        monkeypatch.delenv(given, raising=False)
    try:
        check_tiers(tmp_path, name, tier, node)
    finally:
        shutil.rmtree(node, ignore_errors=True)  # the node tier outlives the cluster by design
        with contextlib.suppress(OSError):
            node.parent.rmdir()  # when no other cluster's node tier is in it


def check_tiers(tmp_path: Path, name: str, tier: Path, node: Path) -> None:
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
        assert http_json(decode + wire.TIER_HELD_PATH, {"messages": first})[0] == 401

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
        assert sum(intact(entry, tier) for entry in tier.rglob("*.bin")) >= 4
    # the engines took their host regions (host_gib each in /dev/shm) with them
    assert set(SHM_DIR.glob("vllm_offload_*")) - regions_before == set()


# --- the tier outlives its cluster: `pdserve down`, `pdserve up` of the same config ------------------


def restart_spec(tier_dir: Path, name: str) -> dict:
    """A shared tier only: the node tier (/dev/shm) outlives a cluster too, and is looked up first."""
    return spec(tier_dir, name) | {"kv_tier": {"host_gib": 0.25, "shared_gib": 1, "shared_path": str(tier_dir)}}


def long_prompt(topic: str) -> list[dict]:
    """About 1,800 tokens; two topics differ from the first block on, so they share no entry."""
    return [{"role": "user", "content": f"About {topic}: " + STORY * 50 + f"What did they write about {topic}?"}]


def chunk_files(engine: dict, headers: dict[str, str], messages: list[dict]) -> tuple[int, list[Path]]:
    """The tokens of one chunk and, in order, the shared tier's entry of each full chunk of the prompt, named as
    the engine names them (its tokenizer and chat template, its tier's layout: ``connectors.tier.held``)."""
    code, _, answer = http_json(engine["url"] + "/tokenize", {"model": MODEL, "messages": messages}, headers=headers)
    assert code == 200, answer
    layout = TierLayout.from_json((Path(engine["log_path"] + ".tiers") / f"{wire.SHARED_TIER}.json").read_text())
    hashes = block_hashes(answer["tokens"], layout.tokens_per_hash, TIER_HASH_ALGO)
    ((group, per_chunk),) = layout.groups
    files = [Path(layout.file_name(hashes[last], group)) for last in range(per_chunk - 1, len(hashes), per_chunk)]
    return per_chunk * layout.tokens_per_hash, files


def until(condition: Callable[[], object], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.25)


def counter(engine: dict, headers: dict[str, str], name: str, **labels: str) -> float:
    return total(metrics(engine["url"], headers), name, **labels)


def test_a_prompt_stored_before_down_is_loaded_after_up_and_an_altered_entry_is_recomputed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pdserve up`, `pdserve down`, `pdserve up` of one config, no secret given (each `up` makes its own): the
    second cluster loads nearly all of a long prompt from the shared tier the first one stored, and answers as
    it did. An entry altered on disk is refused (counted corrupt, deleted), its block computed again and stored
    again, and the answer does not change. What an older pdserve left (a format-2 namespace) is removed when the
    tier opens; a file the tier did not write stays."""
    for given in (SECRET_ENV, SECRET_FILE_ENV):
        monkeypatch.delenv(given, raising=False)
    tier = tmp_path / "tier"
    config = restart_spec(tier, f"pdserve-kv-restart-{secrets.token_hex(3)}")
    kept, altered = long_prompt("the wind"), long_prompt("the oil")
    cluster_secrets, first_answers, files = [], [], []
    with own_cluster(tmp_path, config) as status:
        headers = engine_headers(status["state_dir"])
        prefill = next(e for e in status["engines"] if e["role"] == "prefill")
        cluster_secrets.append(read_secret_file(Path(status["state_dir"]) / "cluster-secret"))
        for messages in (kept, altered):
            first_answers.append(chat(status["proxy_url"], messages))
            chunk_tokens, entries = chunk_files(prefill, headers, messages)
            files.append(entries)
            until(lambda entries=entries: all(f.exists() for f in entries), "the prompt's chunks in the shared tier")
    assert len(files[0]) >= 6, f"{len(files[0])} chunks of {chunk_tokens} tokens: the prompt is too short"

    old_namespace = tier / "pdserve-v2-cpu-4096"  # as pdserve before the tier's own key laid it out
    old_entry = old_namespace / "smollm2_0123456789ab_r0" / "abc" / "de_g0" / ("abcde" + "0" * 59 + ".bin")
    old_entry.parent.mkdir(parents=True)
    old_entry.write_bytes(bytes(HEADER.size + 4096))
    (tier / "notes.txt").write_text("the user's")

    with own_cluster(tmp_path, config) as status:  # the same cluster.yaml, the same state directory
        url, headers = status["proxy_url"], engine_headers(status["state_dir"])
        prefill = next(e for e in status["engines"] if e["role"] == "prefill")
        cluster_secrets.append(read_secret_file(Path(status["state_dir"]) / "cluster-secret"))
        assert cluster_secrets[0] != cluster_secrets[1]  # nothing of the tier depends on it
        assert not old_namespace.exists() and (tier / "notes.txt").read_text() == "the user's"
        key = load_tier_key(tier)
        assert (stat.S_IMODE(key.path.stat().st_mode), stat.S_IMODE(tier.stat().st_mode)) == (0o600, 0o700)
        assert [chunk_files(prefill, headers, m)[1] for m in (kept, altered)] == files  # the same names: one key

        # 1. Nearly all of the prompt comes from the shared tier: the new engines' caches are empty.
        before = metrics(prefill["url"], headers)
        code, _, answer = ask(url, kept)
        assert code == 200, answer
        assert answer["choices"][0]["message"]["content"] == first_answers[0]
        prompt_tokens = answer["usage"]["prompt_tokens"]

        def from_disk() -> float:
            name = "vllm:prompt_tokens_cached_by_source_total"
            return counter(prefill, headers, name, source="disk") - total(before, name, source="disk")

        until(lambda: from_disk() > 0, "the prefill engine's count of prompt tokens loaded from the tier")
        loaded = from_disk()
        assert loaded >= prompt_tokens - 2 * chunk_tokens and loaded >= 0.85 * prompt_tokens, (loaded, prompt_tokens)
        hits = counter(prefill, headers, "pdserve:kv_tier_hits_total", tier=wire.SHARED_TIER)
        assert hits - total(before, "pdserve:kv_tier_hits_total", tier=wire.SHARED_TIER) >= len(files[0]) - 1
        corrupt_name = "pdserve:kv_tier_corrupt_entries_total"
        assert counter(prefill, headers, corrupt_name, tier=wire.SHARED_TIER) == 0

        # 2. One entry of the other prompt altered on disk (one flipped byte of its KV): refused, its block and
        #    those after it computed again, the answer the same, and the block stored again, intact.
        victim = files[1][len(files[1]) // 2]
        assert intact(victim, tier)
        data = bytearray(victim.read_bytes())
        data[HEADER.size + (len(data) - HEADER.size) // 2] ^= 0x5A
        victim.write_bytes(bytes(data))
        assert not intact(victim, tier)
        victim.write_bytes(bytes(data))  # intact() deleted it, as the tier does
        code, _, answer = ask(url, altered)
        assert code == 200, answer
        assert answer["choices"][0]["message"]["content"] == first_answers[1]
        until(lambda: counter(prefill, headers, corrupt_name, tier=wire.SHARED_TIER) >= 1, "the refused entry counted")
        assert counter(prefill, headers, corrupt_name, tier=wire.SHARED_TIER) == 1  # that one, no other
        until(lambda: victim.exists() and intact(victim, tier), "the recomputed block stored again")
        assert all(intact(entry, tier) for entry in files[1])
