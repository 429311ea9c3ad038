"""The simulator against a real cluster: replay a trace through the proxy, compare latency quantiles.

``replay`` sends each request of a trace at its time to a running cluster's
proxy (a streamed completion of ``prompt_tokens`` random token ids, fresh per
request so no prefix cache helps, and exactly ``output_tokens`` tokens with
``ignore_eos``) and keeps each one's TTFT (arrival to the first streamed token)
and mean inter-token latency. ``compare`` sets those against the simulator's
records of the same trace, per metric and quantile. ``lab/validate_simulator.py``
and the integration suite both use them. ``mean_profile``: the engines' speed over a
replay that was profiled before and after it (``validate_simulator.py --profile-after``).

``client_stalls`` notes the intervals in which the client's side got no CPU: a process in the client's
session (Linux puts each session in an autogroup, which shares the CPU as one) that sleeps 20 ms at a time
and wakes up late. On our 2-core machines, while a cluster (a session of its own) served, such a process
waited 1-5 s in the run queue every few seconds (2026-12-01, ``/proc/self/schedstat``; no steal time, no
memory pressure), where one in a session of its own saw no wait over 0.2 s at the same moments. A request
whose stream spans such a wait measures the client, not the engines. ``replay_apart`` runs a replay and its
watcher in a session of their own (then the client has a share of its own); ``undisturbed`` keeps the
requests clear of every stall that still came.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import operator
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

from contract.headers import PATH as PATH_HEADER
from orchestrator.autoscale import traces
from orchestrator.autoscale.profile import EngineLimits, Grid1D, Grid2D, PerformanceProfile
from orchestrator.autoscale.traces import TraceRequest
from testlib.priority import run_ahead

TOLERANCE = 0.20  # the simulator within 20 % of the cluster, per quantile
MAX_IN_FLIGHT = 1024  # the replay's threads: requests in flight before one is sent late (``late_s``)
HAND_OVER_S = 0.05  # a request goes to its thread this long before its time
QUANTILES = (0.5, 0.9)
# Token ids well inside SmolLM2's vocabulary and clear of its special tokens.
TOKEN_IDS = (1000, 40000)
# A stall: a 20-ms sleep that ended this much late. The backlog it leaves takes a light load a request or two to
# clear, so a request that starts within SETTLE_S of its end is disturbed too.
STALL_S = 0.25
SETTLE_S = 2.0
_WATCHER = """
import sys, time
threshold = float(sys.argv[1])
last = time.time()
while True:
    time.sleep(0.02)
    now = time.time()
    if now - last > 0.02 + threshold:
        print(f"{last + 0.02} {now}", flush=True)
    last = now
"""


def prefill_capacity_rps(
    profile: PerformanceProfile, prefill_engines: int, mix: traces.LengthMix, seed: int = 0
) -> float:
    """Requests per second a prefill pool computes, by the profile, for the mix's prompts one at a time."""
    sample = mix_sample(mix, seed)
    return prefill_engines / statistics.mean(profile.prefill_seconds(r.prompt_tokens) for r in sample)


def decode_capacity_rps(profile: PerformanceProfile, mix: traces.LengthMix, seed: int = 0) -> float:
    """Requests per second one decode engine answers, by the profile, at its full batch (``max_num_seqs``) of the
    mix's requests halfway through their answers: its tokens per second over the mix's mean answer."""
    sample = mix_sample(mix, seed)
    context = statistics.mean(r.prompt_tokens + r.output_tokens / 2 for r in sample)
    batch = profile.engine.max_num_seqs
    tokens_per_s = batch / profile.decode_step_seconds(batch, context)
    return tokens_per_s / statistics.mean(r.output_tokens for r in sample)


def mix_sample(mix: traces.LengthMix, seed: int) -> list[TraceRequest]:
    """~1000 draws of the mix, the same for a seed: what the capacities above average over."""
    return traces.poisson(50.0, 20.0, mix, seed=seed)


def replay(proxy_url: str, model: str, trace: list[TraceRequest], headers: dict[str, str] | None = None) -> list[dict]:
    """Send every request at its time, however many are in flight (an open loop: ``MAX_IN_FLIGHT`` threads,
    each request handed to one at its time); per request ``{"ttft_s", "itl_s", "longest_gap_s",
    "longest_gap_at", "sent_at", "ended_at", "late_s", "chunks", "path"}`` (``itl_s``: the mean gap between
    chunks; ``*_at``: wall-clock times; ``late_s``: how much after its time it was sent; ``path``: the proxy's
    ``X-PDServe-Path``, e.g. ``decode-only; reason=...``) or ``{"failed": why}``."""
    # Never seeded: prompts another replay sent (a lower load of the same seed, a test before) would hit the
    # engines' prefix caches, and a trace's second run would prefill for free.
    rng = random.Random()
    prompts = [[rng.randrange(*TOKEN_IDS) for _ in range(r.prompt_tokens)] for r in trace]
    start = time.perf_counter()
    wall = time.time() - start

    def one(index: int) -> dict:
        request = trace[index]
        due = start + request.t
        time.sleep(max(0.0, due - time.perf_counter()))
        sent = time.perf_counter()
        body = {
            "model": model,
            "prompt": prompts[index],
            "max_tokens": request.output_tokens,
            "min_tokens": request.output_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        http = urllib.request.Request(
            proxy_url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        stamps = []
        try:
            with urllib.request.urlopen(http, timeout=900) as response:
                path = response.headers.get(PATH_HEADER, "")
                for raw in response:
                    line = raw.decode().strip()
                    if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                        stamps.append(time.perf_counter())
        except OSError as e:  # counted, and kept out of the latencies
            return {"failed": f"{type(e).__name__}: {e}"}
        if not stamps:
            return {"failed": "no token came back"}
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        itl_s = statistics.mean(gaps) if gaps else 0.0
        longest = max(range(len(gaps)), key=gaps.__getitem__, default=None)
        return {
            "ttft_s": stamps[0] - sent,
            "itl_s": itl_s,
            "longest_gap_s": gaps[longest] if gaps else 0.0,
            # when it began, on the wall clock: to find it in the engines' and the proxy's logs
            "longest_gap_at": wall + stamps[longest] if gaps else None,
            "sent_at": wall + sent,
            "ended_at": wall + stamps[-1],
            "late_s": sent - due,
            "chunks": len(stamps),
            "path": path,
        }

    # Each request goes to a thread at its time (less HAND_OVER_S), so a free thread is there for it as long as
    # fewer than MAX_IN_FLIGHT are in flight. A pool that took every request at once capped what was in flight
    # at its size: on 2026-12-04 its 64 threads held the cold run's decode engines at 63-64 running while the
    # trace wanted ~104, and a request's TTFT, timed from when a thread sent it, hid the queue.
    with concurrent.futures.ThreadPoolExecutor(max_workers=MAX_IN_FLIGHT) as pool:
        futures = []
        for index, request in enumerate(trace):
            time.sleep(max(0.0, start + request.t - HAND_OVER_S - time.perf_counter()))
            futures.append(pool.submit(one, index))
        return [future.result() for future in futures]


@contextlib.contextmanager
def client_stalls(threshold_s: float = STALL_S) -> Iterator[list[tuple[float, float]]]:
    """The wall-clock intervals (start, end) in which a process in this one's session woke up over
    ``threshold_s`` late, filled in when the block ends."""
    watcher = subprocess.Popen([sys.executable, "-c", _WATCHER, str(threshold_s)], stdout=subprocess.PIPE, text=True)
    stalls: list[tuple[float, float]] = []
    try:
        yield stalls
    finally:
        watcher.terminate()
        out, _ = watcher.communicate(timeout=10)
        stalls.extend((float(start), float(end)) for start, end in (line.split() for line in out.splitlines()))


def replay_apart(
    proxy_url: str, model: str, trace: list[TraceRequest], headers: dict[str, str] | None = None
) -> tuple[list[dict], list[tuple[float, float]]]:
    """``replay`` in a process of a session of its own, and the stalls (``client_stalls``) seen in that session."""
    job = {"proxy_url": proxy_url, "model": model, "trace": [dataclasses.astuple(r) for r in trace], "headers": headers}
    done = subprocess.run(
        [sys.executable, "-m", "testlib.fidelity"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],  # the repository: testlib, orchestrator
        start_new_session=True,
        preexec_fn=run_ahead,  # its client and watcher ahead of the engines on the CPU
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the replay's process failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout)
    return result["answers"], [(start, end) for start, end in result["stalls"]]


def _replay_job() -> None:
    """``replay_apart``'s process: the job on stdin, the answers and stalls on stdout."""
    job = json.load(sys.stdin)
    trace = [TraceRequest(*row) for row in job["trace"]]
    with client_stalls() as stalls:
        answers = replay(job["proxy_url"], job["model"], trace, job["headers"])
    json.dump({"answers": answers, "stalls": stalls}, sys.stdout)


def undisturbed(answers: list[dict], stalls: list[tuple[float, float]], settle_s: float = SETTLE_S) -> list[int]:
    """The indices of ``replay``'s answers that neither failed nor overlapped a stall (or the ``settle_s`` after
    it)."""
    return [
        i
        for i, answer in enumerate(answers)
        if "failed" not in answer
        and not any(answer["sent_at"] < end + settle_s and start < answer["ended_at"] for start, end in stalls)
    ]


def quantile(values: list[float], q: float) -> float:
    if not values:
        raise ValueError("no values to take a quantile of")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency_quantiles(rows: list, value: Callable[[Any, str], float] = getattr) -> dict[str, float]:
    """Each quantile of TTFT and ITL (s) over ``rows``, named ``"TTFT p50"``...; ``value(row, "ttft_s")``
    reads a row (default: an attribute, as of the simulator's records; ``operator.getitem`` for dicts)."""
    return {
        f"{name} p{round(q * 100)}": quantile([value(row, key) for row in rows], q)
        for name, key in (("TTFT", "ttft_s"), ("ITL", "itl_s"))
        for q in QUANTILES
    }


def compare(measured: list[dict], simulated: list) -> dict[str, dict[str, float]]:
    """Per metric and quantile (``"TTFT p50"``...): the cluster's value, the simulator's, and their ratio.

    ``measured`` holds ``replay``'s answers that did not fail; ``simulated`` the
    simulator's records (``ttft_s``, ``itl_s``) of the same trace.
    """
    real, sim = latency_quantiles(measured, operator.getitem), latency_quantiles(simulated)
    return {
        name: {
            "cluster_s": round(real[name], 4),
            "simulator_s": round(sim[name], 4),
            "ratio": round(sim[name] / real[name], 3),
        }
        for name in real
    }


def within(rows: dict[str, dict[str, float]], tolerance: float = TOLERANCE) -> bool:
    return all(abs(row["ratio"] - 1) <= tolerance for row in rows.values())


def mean_profile(a: PerformanceProfile, b: PerformanceProfile, name: str, provenance: str) -> PerformanceProfile:
    """The mean of two profiles of one cluster, on ``a``'s grid (``b`` read there): the engines' speed over
    a span that ``a``'s measurement began and ``b``'s ended, on a machine whose speed moves."""

    def grid2d(x: Grid2D, y: Grid2D) -> Grid2D:
        seconds = [[(x.seconds[i][j] + y(r, c)) / 2 for j, c in enumerate(x.cols)] for i, r in enumerate(x.rows)]
        return Grid2D(list(x.rows), list(x.cols), seconds)

    engine = {
        f.name: (
            round((getattr(a.engine, f.name) + getattr(b.engine, f.name)) / 2)
            if isinstance(getattr(a.engine, f.name), int)
            else (getattr(a.engine, f.name) + getattr(b.engine, f.name)) / 2
        )
        for f in fields(EngineLimits)
    }
    return PerformanceProfile(
        name=name,
        provenance=provenance,
        engine=EngineLimits(**engine),
        prefill=grid2d(a.prefill, b.prefill),
        decode=grid2d(a.decode, b.decode),
        transfer=Grid1D(
            list(a.transfer.x), [(v + b.transfer(x)) / 2 for x, v in zip(a.transfer.x, a.transfer.y, strict=True)]
        ),
    )


if __name__ == "__main__":
    _replay_job()
