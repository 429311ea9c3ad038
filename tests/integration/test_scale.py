"""``pdserve scale`` on a real cluster: a pool grows, serves on its new engine, takes a draining
engine back when it grows again, and shrinks again while requests run, without failing one of them;
an engine that cannot start (its port is taken) fails the scale with its reason, and the controller
starts it again after its back-off until it serves; a scale-down during a start ends the start at once;
``--move`` takes a ready engine from one pool to the other and back while requests run, without a restart; while
it serves decode, kill -9 of the other decode engine under load fails none of its requests (the moved engine
carries them on, streams continued from the tokens sent).

Its own cluster (three engines at most on this machine's two cores:
``resources.share_cores``), after the shared one is stopped.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import socket
import time
from pathlib import Path

import psutil
import pytest
import yaml

from contract import wire
from orchestrator.engine_processes import parse_cores
from tests.integration.clients import CLIENT_MIX, answers_equal, kill_outcome, kill_under_load, mixed_send
from tests.integration.conftest import HERE, engine_headers, http_json, own_cluster, run_pdserve

pytestmark = [pytest.mark.integration, pytest.mark.after_cluster]

MODEL = "smollm2-135m-instruct"
LEASE_TTL_S = 25  # how long prefill-1 holds KV nobody reads: what keeps it draining below


def spec() -> dict:
    base = yaml.safe_load((HERE / "cluster.yaml").read_text())
    return base | {
        "name": "pdserve-scale",
        "proxy": {"port": 18300},
        "prefill": base["prefill"] | {"port": 18400, "kv_port": 15800},
        "decode": base["decode"] | {"port": 18500, "kv_port": 15900},
        "resources": {"share_cores": True},
        "connector_options": {"lease_ttl_s": LEASE_TTL_S},
        "autoscaling": {
            "prefill": {"min": 1, "max": 2},
            "decode": {"min": 1, "max": 2},
            "max_engines": 3,
            "targets": {"ttft_p90_s": 30, "itl_p90_s": 5},
            "interval_s": 3600,  # no automatic decision during this test: only `pdserve scale`
        },
    }


def ask(proxy_url: str, n: int, words: int = 0) -> tuple[int, str]:
    """A chat request (with ``words`` words of padding: a long prompt); its status and who prefilled it."""
    content = "word " * words + f"Say the number {n}."
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8}
    status, headers, answer = http_json(proxy_url + "/v1/chat/completions", body, timeout=300)
    return status, headers.get("x-pdserve-prefill", "") if status == 200 else str(answer)


def hold_kv(env: dict[str, str], engine_id: str) -> None:
    """The proxy's first phase sent straight to ``engine_id``, with no second: the engine holds that prompt's
    KV for a decode engine until the lease ends (``lease_ttl_s``), and a drain waits for it."""
    status = json.loads(run_pdserve("status", "--json", env=env).stdout)
    url = next(e["url"] for e in status["engines"] if e["engine_id"] == engine_id)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hold this."}],
        "max_tokens": 1,
        wire.KV_TRANSFER_PARAMS: {wire.DO_REMOTE_DECODE: True},
    }
    code, _, answer = http_json(url + "/v1/chat/completions", body, headers=engine_headers(env["PDSERVE_STATE_DIR"]))
    assert code == 200 and answer[wire.KV_TRANSFER_PARAMS][wire.REMOTE_BLOCK_IDS], answer


def test_scale_prefill_up_then_down_under_load(tmp_path: Path) -> None:
    with own_cluster(tmp_path, spec()) as status:
        env = dict(os.environ, PDSERVE_STATE_DIR=str(tmp_path / "state"))  # own_cluster's
        env.pop("RAY_ADDRESS", None)
        proxy_url = status["proxy_url"]
        assert status["pools"]["prefill"] == {"target": 1, "max": 2, "ready": 1, "moving": 0, "draining": 0}

        # The first scale-up: prefill-1 cannot start while something else holds its port. The scale fails with
        # the reason, and prefill-1 holds its replica. The controller starts it again after each back-off (10 s,
        # 20 s, ...); once the port is free, the pool reaches its target with no one asking again.
        port = spec()["prefill"]["port"] + 1
        with socket.create_server(("127.0.0.1", port)):
            failed = run_pdserve("scale", "prefill=2", env=env, timeout=900)
            assert failed.returncode == 1 and "prefill-1 failed to start" in failed.stderr, failed.stderr
            record = engine_record(env, "prefill-1")
            assert record["state"] == "failed" and record["failures"] >= 1, record
            assert "address already in use" in record["error"].lower(), record["error"]
            assert "a back-off" in failed.stderr
        deadline = time.monotonic() + 600
        while (record := engine_record(env, "prefill-1"))["state"] != "ready" and time.monotonic() < deadline:
            time.sleep(2)
        assert record["state"] == "ready" and record["failures"] == 0, record
        events = [e["message"] for e in json.loads(run_pdserve("status", "--json", env=env).stdout)["events"]]
        assert any(m.startswith("prefill-1 starting again") for m in events), events[-10:]
        served_by = {ask(proxy_url, n)[1] for n in range(4)}
        assert served_by == {"prefill-0", "prefill-1"}  # round robin reaches the new engine

        # Moves: prefill-1 becomes a decode engine and back while requests run, without a restart (same pid).
        pid = engine_record(env, "prefill-1")["pid"]
        for way, role in (("prefill->decode", "decode"), ("decode->prefill", "prefill")):
            with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
                load = [pool.submit(ask_engines, proxy_url, n) for n in range(9)]
                time.sleep(1.0)
                moved = run_pdserve("scale", "--move", way, env=env, timeout=600)
                results = [future.result() for future in load]
            assert moved.returncode == 0, moved.stdout + moved.stderr
            assert f"prefill-1 moving {way.replace('->', ' -> ')}" in moved.stdout, moved.stdout
            assert f"prefill-1 serves {role} now: moved in" in moved.stdout, moved.stdout
            assert [s for s, *_ in results] == [200] * len(results), results
            record = engine_record(env, "prefill-1")
            assert (record["role"], record["state"], record["pid"]) == (role, "ready", pid), record
            served = {
                engines[0 if role == "prefill" else 1] for _, *engines in (ask_engines(proxy_url, n) for n in range(6))
            }
            assert "prefill-1" in served, served
            if role == "decode":
                kill_one_of_two_decode_engines(env, proxy_url)
        status = json.loads(run_pdserve("status", "--json", env=env).stdout)
        assert [(m["engine_id"], m["from"], m["to"]) for m in status["moves"]] == [
            ("prefill-1", "prefill", "decode"), ("prefill-1", "decode", "prefill")]  # fmt: skip
        refused = run_pdserve("scale", "--move", "decode->prefill", env=env)
        assert refused.returncode == 1 and "would leave decode below its minimum (1)" in refused.stderr

        # Shrink while long prompts run, and grow again while prefill-1 still drains: the scale-up takes
        # prefill-1 back (it serves again at once) instead of waiting for it to stop and start. What keeps it
        # draining is KV it holds for nobody (until LEASE_TTL_S), not the long prompts, which a fast machine
        # may prefill before the scale-up comes (CI once did).
        hold_kv(env, "prefill-1")
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            long = [pool.submit(ask, proxy_url, n, 3000) for n in range(4)]
            time.sleep(1.0)
            draining = run_pdserve("scale", "prefill=1", "--no-wait", env=env)
            back = run_pdserve("scale", "prefill=2", env=env, timeout=900)
            long_results = [future.result() for future in long]
        assert draining.returncode == 0 and back.returncode == 0, draining.stderr + back.stderr
        assert "prefill-1 taken back" in back.stdout and "prefill 2/2 ready" in back.stdout, back.stdout
        assert "prefill-1 stopped" not in back.stdout and "prefill-1 ready in" not in back.stdout
        assert [s for s, _ in long_results] == [200] * 4, long_results
        assert {ask(proxy_url, n)[1] for n in range(4)} == {"prefill-0", "prefill-1"}

        # Shrink while requests keep coming: prefill-1 leaves the pool, finishes, then stops.
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            load = [pool.submit(ask, proxy_url, n) for n in range(12)]
            time.sleep(1.0)
            shrunk = run_pdserve("scale", "prefill=1", env=env, timeout=900)
            results = [future.result() for future in load]
        assert shrunk.returncode == 0, shrunk.stderr
        assert "prefill-1 draining" in shrunk.stdout and "prefill-1 stopped" in shrunk.stdout
        assert [s for s, _ in results] == [200] * len(results), results

        after = run_pdserve("status", "--json", env=env)
        engines = {e["engine_id"] for e in json.loads(after.stdout)["engines"]}
        assert engines == {"prefill-0", "decode-0"}
        assert {ask(proxy_url, n)[1] for n in range(3)} == {"prefill-0"}

        refused = run_pdserve("scale", "prefill=3", env=env)
        assert refused.returncode == 1 and "outside 1..2" in refused.stderr

        # A scale-down while prefill-1 starts ends its start: vLLM's wait for its engine core blocks the engine
        # actor's main loop, so the stop (on a loop of its own) terminates the start's processes. It took the
        # rest of the start (43-59 s here) when the stop waited on that loop.
        assert run_pdserve("scale", "prefill=1", env=env, timeout=900).returncode == 0
        load_s = engine_record(env, "prefill-0")["load_s"]
        assert run_pdserve("scale", "prefill=2", "--no-wait", env=env).returncode == 0
        time.sleep(min(15.0, load_s / 3))  # well into its start
        assert engine_record(env, "prefill-1")["state"] == "starting"
        # Its start runs on its cores from the first (vLLM's imports, weights and warm-up take a core for a
        # minute): before, only a ready engine was pinned, and a start under load slowed the engines on other cores.
        cores, affinities = starting_affinities(env, "prefill-1")
        assert affinities and set(affinities.values()) == {cores}, (cores, affinities)
        started = time.monotonic()
        stopped = run_pdserve("scale", "prefill=1", env=env, timeout=900)
        took = time.monotonic() - started
        assert stopped.returncode == 0 and "prefill-1 stopped" in stopped.stdout, stopped.stdout + stopped.stderr
        assert took < load_s / 2, f"the stop took {took:.1f}s; a whole start takes {load_s:.1f}s"
        deadline = time.monotonic() + 30
        while (strays := vllm_processes_outside(env)) and time.monotonic() < deadline:
            time.sleep(1)
        assert strays == [], strays


def kill_one_of_two_decode_engines(env: dict[str, str], proxy_url: str) -> None:
    """kill -9 of decode-0 under greedy load, streamed and not, while prefill-1 serves decode too: what decode-0
    had goes on on prefill-1 (a non-streamed request computed again, a stream continued from the tokens sent),
    none fails, and every answer is the one an engine gives alone once decode-0 is back."""
    decode = engine_record(env, "decode-0")
    started = time.monotonic()
    send = mixed_send(proxy_url, MODEL, "describe a lighthouse", max_tokens=32)
    results, kill = kill_under_load(decode["pid"], len(CLIENT_MIX), send, lambda r: r[3]["path"] == "disaggregated")
    outcome = kill_outcome(results, kill)
    print(f"kill of one of two decode engines: {outcome} ({time.monotonic() - started:.0f} s under load)")
    assert outcome.in_flight and not outcome.failed, outcome.failed
    assert all(r.seen["migrated"] == "decode-0" for r in outcome.moved), outcome.moved
    assert all("continued on decode engine prefill-1" in r.seen["comments"][0] for r in outcome.continued)
    deadline = time.monotonic() + 600  # Ray restarts the actor; the controller starts vLLM in it again
    while (record := engine_record(env, "decode-0"))["state"] != "ready" or record["pid"] == decode["pid"]:
        assert time.monotonic() < deadline, record
        time.sleep(2)
    restarted = time.monotonic()
    compared = answers_equal(proxy_url, outcome.to_compare())
    print(
        f"kill of one of two decode engines: decode-0 back {restarted - started:.0f} s after the load began; "
        f"{compared} answers compared with an engine's alone, all equal"
    )


def starting_affinities(env: dict[str, str], engine_id: str) -> tuple[frozenset[int], dict[str, frozenset[int]]]:
    """The cores the event log gives ``engine_id`` ("prefill-1 loading (cores 1, port ...)"), and the CPU affinity
    of each process of its actor while it starts: the Ray worker of an engine actor that no engine in the status
    holds yet, and its children."""
    status = json.loads(run_pdserve("status", "--json", env=env).stdout)
    loading = [e["message"] for e in status["events"] if e["message"].startswith(f"{engine_id} loading (cores ")]
    cores = frozenset(parse_cores(loading[-1].split("(cores ", 1)[1].split(",", 1)[0]))
    known = {e["pid"] for e in status["engines"] if e.get("pid")}
    affinities = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            title = " ".join(proc.info["cmdline"] or [])
            if title.startswith("ray::EngineActor") and proc.pid not in known:
                for member in [proc, *proc.children(recursive=True)]:
                    affinities[f"{member.pid} {member.name()}"] = frozenset(member.cpu_affinity())
    return cores, affinities


def ask_engines(proxy_url: str, n: int) -> tuple[int, str, str]:
    """A short chat request: its status and the engines that prefilled and decoded it."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {n}."}], "max_tokens": 16}
    status, headers, _ = http_json(proxy_url + "/v1/chat/completions", body, timeout=300)
    return status, headers.get("x-pdserve-prefill", ""), headers.get("x-pdserve-decode", "")


def vllm_processes_outside(env: dict[str, str]) -> list[str]:
    """vLLM's processes (engine cores, workers) that belong to none of the cluster's engines."""
    engines = {e["pid"] for e in json.loads(run_pdserve("status", "--json", env=env).stdout)["engines"]}
    strays = []
    for proc in psutil.process_iter(["name"]):
        with contextlib.suppress(psutil.Error):
            if (proc.info["name"] or "").startswith("VLLM::") and not engines & {p.pid for p in proc.parents()}:
                strays.append(f"{proc.pid} {proc.info['name']}")
    return strays


def engine_record(env: dict[str, str], engine_id: str) -> dict:
    engines = json.loads(run_pdserve("status", "--json", env=env).stdout)["engines"]
    return next(e for e in engines if e["engine_id"] == engine_id)
