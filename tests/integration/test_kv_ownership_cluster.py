"""Who owns a KV block, on the real cluster (Ray, vLLM CPU engines, NIXL): what a client sees when loads go wrong.

- A READ aborted while NIXL still moves it (``transfer_timeout_s`` forced to 1 ms, UCX over TCP: every READ of a
  long prompt is still in progress when the decode engine next looks at it) never changes an answer: the load is
  reported failed only once NIXL let go of the READ (or its blocks are quarantined), the decode engine computes
  the prompt into blocks no READ lands in, and every greedy answer (``X-PDServe-KV: source=recomputed;
  reason=transport``) is what the decode engine alone answers for that prompt.
- kill -9 of the prefill engine (its whole process tree) while loads are under way (each READ held 6 s, pinned,
  before it is posted; two loads of the test's own pinned before the kill, to be posted 1.5 s apart after it):
  every request sent after the kill is answered, and once Ray and the controller have the engine back, the decode
  engine loads KV from the new start within seconds. A failed READ used to drop the mapping a pinned load was about
  to post through: that load's post raised at every step, and the decode engine's loads failed until its lease
  ended, two minutes after its prefill.
- kill -9 of one of two decode engines under load with vLLM's NixlConnector (``connector: vllm-nixl``): every
  request is answered, and every greedy one equals the prefill engine's answer alone (the proxy moves a decode
  leg off the dead engine with the prompt computed again, never with transfer parameters the dead engine may
  have read: their blocks may hold another prompt's KV by then).

Each test starts a cluster of its own (after the shared one, ``after_cluster``) and stops it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml

from contract import wire
from tests.integration.clients import ask, kill_outcome, kill_under_load
from tests.integration.conftest import HERE, engine_headers, http_json, metric_values, own_cluster
from tests.integration.test_pdserve_connector import metric_total

pytestmark = [pytest.mark.integration, pytest.mark.after_cluster]

MODEL = "smollm2-135m-instruct"
CHAT = "/v1/chat/completions"
FAILURES = "pdserve:kv_transfer_failures_total"
QUARANTINED = "pdserve:kv_quarantined_blocks_total"
SENTENCE = "The river turns past the mill, the bridge and the market square of the old town. "  # ~17 tokens


def spec(name: str, ports: int, **changes) -> dict:
    """The shared cluster's spec (``cluster.yaml``) as a cluster of its own: HTTP ports from ``ports`` (proxy,
    prefill +100, decode +200), side channels from ``ports - 4000``; float32, so a greedy answer does not
    depend on the batch it was computed in (bf16 sums differ with the batch's shape)."""
    base = yaml.safe_load((HERE / "cluster.yaml").read_text())
    engine = {"max_model_len": 4096, "kv_cache_gib": 1, "dtype": "float32"}
    return base | {
        "name": name,
        "proxy": {"port": ports},
        "prefill": base["prefill"] | {"port": ports + 100, "kv_port": ports - 4000},
        "decode": base["decode"] | {"port": ports + 200, "kv_port": ports - 3900},
        "engine": engine,
    } | changes  # fmt: skip


def long_prompt(n: int, sentences: int) -> str:
    """A prompt of its own from the first token (no block of it is in any engine's prefix cache): request ``n``,
    then ``sentences`` sentences (~17 tokens each: 8 fill a 128-token block)."""
    return f"Request {n}. Read this and say what the town is like.\n" + SENTENCE * sentences


def chat(content: str, max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": max_tokens, **extra}  # fmt: skip


def kv_of(headers: dict) -> dict[str, str]:
    """``X-PDServe-KV`` as a dict ({} when the answer has none)."""
    value = {name.lower(): v for name, v in headers.items()}.get("x-pdserve-kv", "")
    return dict(item.split("=", 1) for item in value.split("; ") if "=" in item)


def header(headers: dict, name: str) -> str:
    return {key.lower(): v for key, v in headers.items()}.get(name.lower(), "")


def url_of(status: dict, engine_id: str) -> str:
    return next(e["url"] for e in status["engines"] if e["engine_id"] == engine_id)


def pid_of(status: dict, engine_id: str) -> int:
    return next(e["pid"] for e in status["engines"] if e["engine_id"] == engine_id)


# ---------------------------------------------------------------------------------------------- (a) aborted READs


@dataclass
class Answer:
    prompt: str
    kv: dict[str, str]
    path: str
    prompt_tokens: int
    content: str


ABORT_SPEC = spec("pdserve-aborted-reads", 23000, connector="pdserve", connector_options={"transfer_timeout_s": 0.001})
# UCX over TCP: a READ is still in progress when the decode engine next polls it. Over shared memory a READ of
# several MB had landed by then (1 of 12 was aborted), and a READ seen done is not aborted.
ABORT_SPEC["engine"] |= {"env": {"UCX_TLS": "tcp"}}
ABORT_BLOCKS = (1, 3, 6, 4, 8, 2, 5, 3)  # each prompt's length in 128-token blocks, about


def test_a_read_aborted_while_nixl_moves_it_never_changes_the_answer(tmp_path: Path) -> None:
    with own_cluster(tmp_path, ABORT_SPEC) as status:
        state = status["state_dir"]
        decode_url = url_of(status, "decode-0")
        prompts = [long_prompt(n, 8 * blocks) for n, blocks in enumerate(ABORT_BLOCKS)]
        # One engine alone, one request at a time: the decode engine computes each prompt (a cache salt of its
        # own: none of it from its prefix cache, and nothing of it left for the requests below to find there).
        alone = {}
        for n, prompt in enumerate(prompts):
            code, _, answer = http_json(decode_url + CHAT, chat(prompt, 24, cache_salt=f"alone-{n}"),
                                        headers=engine_headers(state))  # fmt: skip
            assert code == 200, answer
            alone[prompt] = answer["choices"][0]["message"]["content"]
        failures_before = metric_values(decode_url, FAILURES, "kind").get("transport", 0)
        quarantined_before = metric_total(decode_url, QUARANTINED)

        def disaggregated(prompt: str) -> Answer:
            code, headers, answer = http_json(status["proxy_url"] + CHAT, chat(prompt, 24))
            assert code == 200, answer
            return Answer(prompt, kv_of(headers), header(headers, "x-pdserve-path"), answer["usage"]["prompt_tokens"],
                          answer["choices"][0]["message"]["content"])  # fmt: skip

        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # three at a time: aborts beside other loads
            results = list(pool.map(disaggregated, prompts))

        recomputed = [r for r in results if r.kv.get("source") == "recomputed"]
        transferred = [r for r in results if r.kv.get("source") == "transfer"]
        failures = eventually_at_least(
            lambda: metric_values(decode_url, FAILURES, "kind").get("transport", 0) - failures_before, len(recomputed)
        )
        quarantined = metric_total(decode_url, QUARANTINED) - quarantined_before
        print(
            f"aborted READs: {len(results)} requests of {min(r.prompt_tokens for r in results)}-"
            f"{max(r.prompt_tokens for r in results)} prompt tokens; {len(recomputed)} recomputed after an aborted "
            f"READ ({sorted({r.kv.get('reason', '') for r in recomputed})}), {len(transferred)} loaded over NIXL; "
            f"{failures:g} transport failures counted, {quarantined:g} blocks quarantined; answers equal to the "
            f"decode engine's alone: {sum(r.content == alone[r.prompt] for r in results)}/{len(results)}"
        )
        for result in results:
            assert result.path == "disaggregated", result
            assert result.content == alone[result.prompt], (result, alone[result.prompt])
        assert len(recomputed) >= len(results) // 2, [r.kv for r in results]  # a 1-ms timeout aborts most READs
        assert all(r.kv.get("reason") == "transport" for r in recomputed), [r.kv for r in recomputed]
        assert failures == len(recomputed)
        # The decode engine still serves after the aborts.
        code, _, answer = http_json(status["proxy_url"] + CHAT, chat(prompts[0] + " Once more.", 8))
        assert code == 200, answer


def eventually_at_least(read, expected: float, timeout_s: float = 20.0) -> float:
    """``read()`` once it reaches ``expected`` (metrics are published once per engine step), or at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (value := read()) < expected and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


# ---------------------------------------------------------------------------------------- (b) the prefill restarts

HOLD_S = 6.0
RESTART_SPEC = spec(
    "pdserve-prefill-restart",
    23300,
    connector="pdserve",
    # each READ waits HOLD_S, pinned, before it is posted: the kill comes while loads are under way
    connector_options={"fault_injection": {"read_hold_s": HOLD_S}},
)
FIRST_TRANSFER_WITHIN_S = 20 + HOLD_S  # within seconds, not two minutes: 20 s, and the hold every READ here waits


@dataclass
class Sent:
    sent: float
    answered: float
    code: int
    path: str
    kv: dict[str, str]


class Load:
    """``clients`` threads, each sending a chat request with a long prompt of its own one after another until
    ``stop``; what each saw in ``results``."""

    def __init__(self, proxy_url: str, clients: int) -> None:
        self.proxy_url = proxy_url
        self.results: list[Sent] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(n,), daemon=True) for n in range(clients)]
        for thread in self._threads:
            thread.start()

    def _client(self, n: int) -> None:
        i = 0
        while not self._stop.is_set():
            sent = time.monotonic()
            body = chat(long_prompt(1000 * (n + 1) + i, 24), 4)  # ~3 blocks
            try:
                code, headers, _ = http_json(self.proxy_url + CHAT, body, timeout=300)
            except OSError as e:  # the proxy itself failed the client
                code, headers = 0, {"x-pdserve-path": f"no answer: {e}"}
            self.results.append(Sent(sent, time.monotonic(), code, header(headers, "x-pdserve-path"), kv_of(headers)))
            i += 1

    def wait_for(self, found, timeout_s: float) -> Sent | None:
        """The first result ``found(result)`` holds for, waiting up to ``timeout_s``; None if none came."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = next((r for r in sorted(self.results, key=lambda r: r.answered) if found(r)), None)
            if match is not None:
                return match
            time.sleep(0.2)
        return None

    def stop(self) -> list[Sent]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=300)
        return self.results


def prefill_leg(url: str, headers: dict[str, str], prompt: str) -> dict:
    """The proxy's first leg, played by the test: the prefill engine computes ``prompt`` and keeps its KV for
    decode-0; its transfer parameters."""
    body = chat(prompt, 1) | {
        wire.KV_TRANSFER_PARAMS: dict(wire.PREFILL_REQUEST_PARAMS, **{wire.PDSERVE_READER: "decode-0"})
    }
    code, _, answer = http_json(url + CHAT, body, headers=headers)
    assert code == 200, answer
    return answer[wire.KV_TRANSFER_PARAMS]


def decode_leg(url: str, headers: dict[str, str], prompt: str, params: dict) -> tuple[int, dict]:
    """The second leg: the decode engine loads the KV ``params`` name (pinned, held ``HOLD_S``, then read) and
    answers; its status and KV report."""
    code, _, answer = http_json(url + CHAT, chat(prompt, 4) | {wire.KV_TRANSFER_PARAMS: params}, headers=headers,
                                timeout=300)  # fmt: skip
    report = (answer.get(wire.KV_TRANSFER_PARAMS) or {}).get(wire.PDSERVE_KV, {})
    return code, {key: report[key] for key in ("source", "reason", "detail") if key in report} | {
        "answered": time.monotonic()
    }


def kill_tree(pid: int) -> None:
    """kill -9 of an engine: its actor's process and every process under it at once (killed alone, the actor
    leaves vLLM's engine core, which holds the KV cache and its NIXL agent, seconds to shut down, serving READs)."""
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGKILL)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def test_after_a_prefill_kill_during_reads_the_decode_engine_loads_from_its_new_start_within_seconds(
    tmp_path: Path,
) -> None:
    with own_cluster(tmp_path, RESTART_SPEC) as status:
        prefill_url, prefill_pid = url_of(status, "prefill-0"), pid_of(status, "prefill-0")
        decode_url, headers = url_of(status, "decode-0"), engine_headers(status["state_dir"])
        load = Load(status["proxy_url"], clients=2)
        try:
            warm = load.wait_for(lambda r: sum(x.kv.get("source") == "transfer" for x in load.results) >= 3, 300)
            assert warm is not None, [(r.code, r.path, r.kv) for r in load.results]
            # Two loads of the test's own, held at once, to be posted 1.5 s apart, 3 s and more after the kill (by
            # then the decode engine's NIXL knows the prefill's agent is gone: a READ posted 1.5 s after the kill was
            # seen to complete). The first one's READ fails; the second posts through the same mapping (the old code
            # had dropped it after the first failure: KeyError at every step until that load's lease ended).
            held = [(prompt, prefill_leg(prefill_url, headers, prompt))
                    for prompt in (long_prompt(1, 24), long_prompt(2, 24))]  # fmt: skip
            with concurrent.futures.ThreadPoolExecutor(2) as legs:
                first = legs.submit(decode_leg, decode_url, headers, *held[0])
                time.sleep(HOLD_S / 4)
                second = legs.submit(decode_leg, decode_url, headers, *held[1])
                time.sleep(HOLD_S / 4)  # its pin granted by now
                kill = time.monotonic()
                kill_tree(prefill_pid)
                cut = [first.result(), second.result()]
            while healthy(prefill_url) and time.monotonic() < kill + 30:
                time.sleep(0.2)
            deadline = time.monotonic() + 600  # Ray restarts the actor; the controller starts vLLM in it again
            while not healthy(prefill_url) and time.monotonic() < deadline:
                time.sleep(0.5)
            ready = time.monotonic()
            assert healthy(prefill_url), "the prefill engine did not come back"
            disaggregated = load.wait_for(lambda r: r.answered > ready and r.path == "disaggregated", 150)
            transfer = load.wait_for(lambda r: r.answered > ready and r.kv.get("source") == "transfer", 150)
        finally:
            results = load.stop()

        in_flight = [r for r in results if r.sent < kill < r.answered]
        after = [r for r in results if r.sent > kill]
        failed = [r for r in results if r.code != 200]
        loads_cut = [r for r in in_flight if r.kv.get("source") == "recomputed"]
        seconds = lambda r: f"{r.answered - ready:.1f} s" if r else "none in 150 s"  # noqa: E731
        print(
            "prefill kill during reads: the two held loads answered "
            f"{[(code, report | {'answered': round(report['answered'] - kill, 1)}) for code, report in cut]} "
            f"(seconds after the kill); the load's "
            f"{len(results)} requests, {len(in_flight)} in flight at the kill "
            f"({len(loads_cut)} of them had their load cut and were recomputed: "
            f"{sorted({r.kv.get('reason', '') for r in loads_cut})}), {len(failed)} failed, {len(after)} sent after "
            f"it ({sum(r.path.startswith('decode-only') for r in after)} decode-only); the prefill engine answered "
            f"again {ready - kill:.1f} s after the kill; after that, the first disaggregated answer came in "
            f"{seconds(disaggregated)}, the first with its KV moved (source=transfer) in {seconds(transfer)}"
        )
        assert [code for code, _ in cut] == [200, 200], cut
        assert all(report.get("source") == "recomputed" for _, report in cut), cut  # their loads were cut
        assert all(r.sent < kill < r.answered for r in failed), [(r.code, r.path) for r in failed]
        assert after and all(r.code == 200 for r in after)
        assert transfer is not None and transfer.answered - ready < FIRST_TRANSFER_WITHIN_S, seconds(transfer)


# ----------------------------------------------------------------------------- (c) a decode engine dies, vllm-nixl

DECODE_KILL_SPEC = spec(
    "pdserve-nixl-decode-kill",
    23600,
    connector="vllm-nixl",
    resources={"share_cores": True},  # three engines on this machine's two cores
)
DECODE_KILL_SPEC["decode"] |= {"replicas": 2}
# 24 blocks of 128 tokens per engine: the prefill engine gives the blocks a decode engine has read (and it freed)
# to the next prompts within seconds, so parameters sent again to the other decode engine would read another
# prompt's KV (what the proxy did with vLLM's NixlConnector before it always released them)
DECODE_KILL_SPEC["engine"] |= {"max_model_len": 512, "extra_args": {"num_gpu_blocks_override": 24}}
COMPLETIONS = "/v1/completions"
GREEDY_MIX = (
    (CHAT, {}),
    (COMPLETIONS, {}),
    (CHAT, {}),
    (COMPLETIONS, {}),
    (CHAT, {"stream": True}),
    (COMPLETIONS, {"stream": True, "stream_options": {"include_usage": True}}),
)
"""Each client's route and what it adds: greedy, mostly not streamed (a non-streamed request the dead engine had
is moved to the other decode engine whole; a stream is continued there from the tokens it sent)."""


def greedy_send(proxy_url: str) -> callable:
    """``send(n, i)`` for ``kill_under_load``: client n's i-th request (a prompt of ~3 blocks of its own), its
    outcome ``(status, seen, path, body)`` as ``clients.mixed_send`` gives it."""

    def send(n: int, i: int) -> tuple[int, dict, str, dict]:
        path, extra = GREEDY_MIX[n]
        text = f"Client {n}, question {i}: what is the town like?\n" + SENTENCE * 20
        prompt = {"messages": [{"role": "user", "content": text}]} if path == CHAT else {"prompt": text}
        body = {"model": MODEL, **prompt, "temperature": 0, "max_tokens": 48, **extra}
        return (*ask(proxy_url + path, body), path, body)

    return send


def alone_answer(url: str, headers: dict[str, str], path: str, body: dict, salt: str) -> str:
    """The engine at ``url`` alone, not streamed, computing the whole prompt (a cache salt of its own)."""
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")} | {"cache_salt": salt}
    code, _, answer = http_json(url + path, plain, headers=headers, timeout=300)
    assert code == 200, answer
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_a_decode_engine_killed_under_load_with_vllms_nixl_connector_changes_no_answer(tmp_path: Path) -> None:
    with own_cluster(tmp_path, DECODE_KILL_SPEC) as status:
        assert sorted(e["engine_id"] for e in status["engines"]) == ["decode-0", "decode-1", "prefill-0"]
        send = greedy_send(status["proxy_url"])
        decode_url = url_of(status, "decode-0")
        results, kill = kill_under_load(
            pid_of(status, "decode-0"),
            len(GREEDY_MIX),
            send,
            lambda r: r[3]["path"] == "disaggregated",
            # the kill finds decode-0 generating: KV it read, which the prefill engine has freed (and reuses)
            when=lambda: metric_total(decode_url, "vllm:num_requests_running") >= 2,
        )
        outcome = kill_outcome(results, kill)
        moved = [r for r in outcome.moved if r.seen["migrated"] == "decode-0"]
        paths = sorted({r.seen["path"] for r in outcome.faithful if r.sent > kill})
        prefill_url, headers = url_of(status, "prefill-0"), engine_headers(status["state_dir"])
        # The requests the kill touched (in flight, moved, continued) and the first three after it, asked alone.
        after = [r for r in outcome.faithful if r.sent > kill][:3]
        touched = {id(r): r for r in [*outcome.in_flight, *moved, *outcome.continued, *after]}
        compared = [r for r in outcome.faithful if id(r) in touched]
        equal = [
            alone_answer(prefill_url, headers, r.path, r.body, f"alone-{n}") == r.seen["text"]
            for n, r in enumerate(compared)
        ]
        print(
            f"decode kill with vllm-nixl: {outcome}; {len(moved)} moved off decode-0 whole, paths after the kill: "
            f"{paths}; answers equal to the prefill engine's alone: {sum(equal)}/{len(equal)}"
        )
        assert outcome.in_flight and not outcome.failed, [(r.status, r.seen) for r in outcome.failed]
        assert moved or outcome.continued, outcome
        assert all(r.seen["path"] == "decode-only; reason=decode-failed" for r in moved), [r.seen for r in moved]
        mismatches = [
            (r.path, r.seen["path"], r.seen["text"]) for r, same in zip(compared, equal, strict=True) if not same
        ]
        assert not mismatches, mismatches
