"""What sharing a CPU core costs a decode engine: a neighbour that starts, and one that computes.

Starts the CPU demo with autoscaling (``--config``, its autoscaler held still), where
prefill-1 runs on decode-0's core (``resources.share_cores``). Then, in one run, with
``--streams`` long answers streamed through the proxy at all times (decode-0 steps a
batch of that many), timing every token:

1. decode-0 alone on its core;
2. ``pdserve scale prefill=2``: prefill-1 starting beside it (how long its start takes, and
   decode-0's gaps meanwhile);
3. prefill-1 ready and idle;
4. prefill-1 computing 1024-token prompts back to back (sent to it directly), while the CPU
   time of every process on the shared core is read from ``/proc`` (who got the core);
5. the streams stopped: prefill-1 computing the same prompts beside an idle decode-0;
6. for each further count in ``--streams`` (e.g. ``8,32``): decode-0 streaming that many
   answers, first beside an idle prefill-1, then beside a computing one (does a bigger
   decode batch slow its neighbour's prefill more?);
7. ``prefill=1`` and ``prefill=2`` again: prefill-1's start beside an idle decode-0.

A start-up's slowdown is the start in 2 over the engines' starts with the cluster (their
``load_s`` after ``pdserve up``), which is what ``pdserve profile`` takes for the profile's
``startup_s`` and the simulator stretches. Probes before 2026-11-27 divided by the start in
7 instead, and a scale-up takes longer than a start with the cluster even beside an idle
engine; ``validate_simulator.py --shared-core`` leaves their start-up out when a newer
probe is among those it averages.

    python lab/probe_shared_start.py [--config F] [--streams 8[,32]] [--json] [--out F]

Its ``shared_core`` (the slowdowns of a prefill pass, a decode step and a start-up beside
one busy engine, and of a decode step beside a start-up, with the first ``--streams``) is
what the simulator's ``SharedCore`` takes: ``validate_simulator.py --shared-core F [F ...]``
(the mean of several probes). The further counts only report: on 2026-11-26 the prefill pass
was 2.84x slower beside 8 streams and 2.22x beside 32, so the simulator keeps one number per
role.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contract.auth import engine_key  # noqa: E402
from orchestrator.state import load_cluster_secret  # noqa: E402
from testlib.cluster_client import make_prompt, pdserve, stream_tokens  # noqa: E402
from testlib.specs import spec_copy  # noqa: E402

READY = re.compile(r"prefill-1 ready in ([0-9.]+)s")
PHASE_S = 30.0  # each steady phase lasts this long


def completion(url: str, model: str, prompt: str, max_tokens: int, headers: dict[str, str]) -> list[float]:
    """One streamed completion; when it was sent, then the time of each token."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    sent, times, _ = stream_tokens(url, body, headers)
    return [sent, *times]


class Load:
    """``count`` clients, each sending its request again as soon as it is answered, until stopped;
    the (time, gap) of every token after a stream's first, and (time, TTFT) of every request."""

    def __init__(self, count: int, send) -> None:  # noqa: ANN001 - send(tag) -> [sent, token times...]
        self.gaps: list[tuple[float, float]] = []
        self.ttfts: list[tuple[float, float]] = []
        self._send = send
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(count)]

    def _run(self, client: int) -> None:
        tag = client * 100_000
        while not self._stop.is_set():
            sent, *times = self._send(tag)
            self.ttfts += [(times[0], times[0] - sent)] if times else []
            self.gaps += [(b, b - a) for a, b in zip(times, times[1:], strict=False)]
            tag += 1

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def median_ms(self, start: float, end: float, of: str = "gaps") -> float | None:
        values = [value for t, value in getattr(self, of) if start <= t < end]
        return round(1000 * statistics.median(values), 1) if values else None


def up_held_still(config_path: str) -> str:
    """``pdserve up --detach`` of a copy of ``config_path`` whose autoscaler never decides (scaled by hand only);
    the copy's path, for the caller to remove after ``pdserve down``."""
    with open(config_path) as f:  # the copy lives elsewhere: its profile by a path that holds there
        profile = Path(config_path).resolve().parent / yaml.safe_load(f)["autoscaling"]["profile"]
    config = spec_copy(config_path, interval_s=3600, profile=str(profile))
    up = pdserve("up", config, "--detach")
    if up.returncode != 0:
        os.unlink(config)
        sys.exit(f"pdserve up failed:\n{up.stdout}\n{up.stderr}")
    return config


def scale(target: int) -> tuple[float, float, float | None]:
    """``pdserve scale prefill=N``: when it began and ended, and prefill-1's start as the controller timed it."""
    began = time.monotonic()
    done = pdserve("scale", f"prefill={target}")
    if done.returncode != 0:
        sys.exit(f"pdserve scale prefill={target} failed:\n{done.stdout}\n{done.stderr}")
    ready = READY.search(done.stdout)
    return began, time.monotonic(), float(ready.group(1)) if ready else None


def cpu_seconds(engines: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each engine's processes, by engine and process name."""
    out: dict[str, float] = {}
    for engine_id, pid in engines.items():
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                times = proc.cpu_times()
                key = f"{engine_id} {proc.name()}"
                out[key] = out.get(key, 0.0) + times.user + times.system
        except psutil.Error:
            continue
    return out


def stream_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of stream counts: {text!r}") from None
    if any(count < 1 for count in counts):
        raise argparse.ArgumentTypeError(f"stream counts must be 1 or more: {text!r}")
    return counts


def beside_batch(count: int, stream, long_prompt, measured: tuple | None = None) -> dict:  # noqa: ANN001
    """decode-0 streaming ``count`` answers beside prefill-1 computing 1024-token prompts: its ITL p50 beside an
    idle and a computing prefill-1, and prefill-1's pass. ``measured``: the (streams, prefill) ``Load``s and the
    (idle, computing) windows of a phase already run; else it runs one, sending with ``stream`` and ``long_prompt``."""
    if measured is None:
        with Load(count, stream) as load:
            time.sleep(5)
            idle = (time.monotonic(), time.monotonic() + PHASE_S)
            time.sleep(PHASE_S)
            with Load(1, long_prompt) as prefill:
                time.sleep(5)
                computing = (time.monotonic(), time.monotonic() + PHASE_S)
                time.sleep(PHASE_S)
        measured = (load, prefill, idle, computing)
    load, prefill, idle, computing = measured
    return {
        "streams": count,
        "decode_itl_p50_ms": {
            "neighbour_idle": load.median_ms(*idle),
            "neighbour_computing": load.median_ms(*computing),
        },
        "prefill_1024_ms": prefill.median_ms(*computing, of="ttfts"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/local-cpu-autoscale.yaml")
    parser.add_argument(
        "--streams",
        type=stream_counts,
        default=(8,),
        help="answers streamed at once (decode-0's batch); several, comma-separated, repeat the computing phase "
        "with each (default: 8)",
    )
    parser.add_argument("--max-tokens", type=int, default=200, help="tokens per streamed answer")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", metavar="FILE", help="also write the result here (JSON)")
    args = parser.parse_args()

    config = up_held_still(args.config)
    itl: dict[str, float | None] = {}
    try:
        status = json.loads(pdserve("status", "--json").stdout)
        proxy, model = status["proxy_url"], status["model"]
        # the engines that started with the cluster: what `pdserve profile` takes for the profile's startup_s
        up_start = round(statistics.mean(e["load_s"] for e in status["engines"] if e.get("load_s")), 1)
        headers = {"Authorization": f"Bearer {engine_key(load_cluster_secret())}"}

        def stream(tag: int) -> list[float]:
            return completion(proxy, model, make_prompt(tag, 64), args.max_tokens, {})

        with Load(args.streams[0], stream) as load:
            time.sleep(PHASE_S + 5)
            began, ended, busy_start = scale(2)
            time.sleep(PHASE_S + 5)
            engines = {e["engine_id"]: e for e in json.loads(pdserve("status", "--json").stdout)["engines"]}
            prefill_1 = engines["prefill-1"]["url"]

            def long_prompt(tag: int) -> list[float]:
                return completion(prefill_1, model, make_prompt(tag, 1024), 1, headers)

            pids = {engine_id: e["pid"] for engine_id, e in engines.items() if e.get("pid")}
            with Load(1, long_prompt) as prefill:
                time.sleep(5)
                computing, cpu_before = time.monotonic(), cpu_seconds(pids)
                time.sleep(PHASE_S)
                cpu_after, computed = cpu_seconds(pids), time.monotonic()
        with Load(1, long_prompt) as prefill_alone:
            time.sleep(PHASE_S)
        idle_window = (ended + 5, ended + 5 + PHASE_S)
        batches = [
            beside_batch(args.streams[0], stream, long_prompt, (load, prefill, idle_window, (computing, computed)))
        ]
        batches += [beside_batch(count, stream, long_prompt) for count in args.streams[1:]]
        passes = {  # a 1024-token prompt's prefill on prefill-1 (its TTFT, sent to the engine itself)
            "decode_idle": prefill_alone.median_ms(0, time.monotonic(), of="ttfts"),
            "decode_busy": batches[0]["prefill_1024_ms"],
        }
        itl = {
            "alone": load.median_ms(began - PHASE_S, began),
            "neighbour_starting": load.median_ms(began + 2, ended - 2),
            "neighbour_idle": load.median_ms(*idle_window),
            "neighbour_computing": load.median_ms(computing, computed),
        }
        scale(1)
        time.sleep(5)
        _, _, idle_start = scale(2)
    finally:
        pdserve("down")
        os.unlink(config)
    window = computed - computing
    result = {
        "config": args.config,
        "streams": args.streams[0],
        "prefill_1_startup_s": {"at_up": up_start, "beside_idle_decode": idle_start, "beside_busy_decode": busy_start},
        "decode_itl_p50_ms": itl,
        "decode_slowdown": {k: round(v / itl["alone"], 2) for k, v in itl.items() if v and itl["alone"]},
        "prefill_1024_ms": passes,
        "prefill_slowdown_beside_busy_decode": round(passes["decode_busy"] / passes["decode_idle"], 2),
        "by_decode_batch": [  # prefill-1's pass beside decode-0 streaming ``streams`` answers
            batch | {"prefill_slowdown": round(batch["prefill_1024_ms"] / passes["decode_idle"], 2)}
            for batch in batches
            if batch["prefill_1024_ms"] and passes["decode_idle"]
        ],
        "cpu_share_while_computing": {  # of one core, per process, the engines on the shared core
            key: round((cpu_after[key] - cpu_before.get(key, 0.0)) / window, 3)
            for key in sorted(cpu_after)
            if key.startswith(("decode-0", "prefill-1"))
        },
    }
    slow = result["decode_slowdown"]
    if "neighbour_computing" in slow and busy_start and idle_start:
        # what the simulator takes (``validate_simulator.py --shared-core``): ``SharedCore``'s fields
        result["shared_core"] = {
            "prefill": max(result["prefill_slowdown_beside_busy_decode"], 1.0),
            "decode": max(slow["neighbour_computing"], 1.0),
            # a scale-up's start beside a busy engine over the profile's startup_s (a start with the cluster)
            "startup": max(round(busy_start / up_start, 2), 1.0),
            "decode_beside_start": max(slow.get("neighbour_starting", 1.0), 1.0),
        }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.config}: decode-0 with {args.streams[0]} streams; prefill-1 on its core")
    print(
        f"  start-up with the cluster {up_start} s; prefill-1's beside an idle decode-0 {idle_start} s, "
        f"beside a busy one {busy_start} s"
    )
    for phase, value in itl.items():
        print(f"  decode-0 ITL p50, {phase}: {value} ms ({result['decode_slowdown'].get(phase)}x)")
    print(f"  prefill-1's 1024-token prompt, decode-0 idle / busy: {' / '.join(map(str, passes.values()))} ms")
    for key, share in result["cpu_share_while_computing"].items():
        print(f"  {key}: {share:.1%} of a core while prefill-1 computed")
    for batch in result["by_decode_batch"]:
        itl = batch["decode_itl_p50_ms"]
        print(
            f"  decode-0 with {batch['streams']} streams: prefill-1's 1024-token prompt {batch['prefill_1024_ms']} ms "
            f"({batch['prefill_slowdown']}x); its ITL p50 {itl['neighbour_idle']} ms beside an idle prefill-1, "
            f"{itl['neighbour_computing']} ms beside a computing one"
        )


if __name__ == "__main__":
    main()
