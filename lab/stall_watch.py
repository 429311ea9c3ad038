"""Watch a running cluster's engines for a stall, and dump every process of a stalled engine's stacks.

A stall: an engine with requests running whose step counter (``vllm:iteration_tokens_total_count``) has not moved
for ``--stall-s`` seconds. Each dump opens with where the engine's threads spent the stall, from the kernel's
accounting (``/proc/PID/task/TID/schedstat`` and ``stat``) since its steps last moved: seconds on a CPU, seconds
runnable but waiting for one (its run queue), page faults, and the rest (asleep: a lock, I/O, a socket). A worker
on a CPU all along computes slowly; one waiting in the run queue is starved by its neighbours; one asleep waits
for something. Then ``py-spy dump`` (``pip install py-spy``; run as root) of each of the engine's
processes, its worker first, then its engine core and its API server, goes to ``--out``: every ``--every-s`` while
the stall lasts, at most ``--dumps`` times. ``--native`` adds the C frames, but pauses each process for
seconds to a minute while it unwinds them (the stall then reads longer than it was). The engines
are found by the HTTP ports the cluster's spec gives every replica its pools may grow to (``--config``), so it
runs beside any lab script: ``python lab/stall_watch.py --out DIR & python lab/validate_simulator.py ...``.

Run from the repository root: ``python lab/stall_watch.py --out DIR [--config FILE] [--stall-s 4] [--for-s 900]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contract.wire import ROLES  # noqa: E402
from orchestrator.spec import ClusterSpec  # noqa: E402

POLL_S = 1.0
FAMILY_S = 30.0
PY_SPY = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))


def read_metrics(port: int) -> tuple[float, float] | None:
    """(requests running, steps) off the engine's ``/metrics``, summed over label sets; None if it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2.0) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    running = steps = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            running += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:iteration_tokens_total_count"):
            steps += float(line.rsplit(" ", 1)[1])
    return running, steps


def listener_pid(port: int) -> int | None:
    """The process listening on ``port`` (``ss``)."""
    out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True).stdout
    for part in out.split("pid=")[1:]:
        return int(part.split(",")[0])
    return None


def family(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


@dataclasses.dataclass(frozen=True)
class ThreadTimes:
    """One thread's kernel accounting at a moment: nanoseconds on a CPU and waiting in a run queue
    (``schedstat``), minor and major page faults, the CPU it last ran on, and its name (``stat``)."""

    name: str
    run_ns: int
    wait_ns: int
    faults: int
    major_faults: int
    cpu: int


def thread_times(pids: list[int]) -> dict[tuple[int, int], ThreadTimes]:
    """Every thread of ``pids``, by (pid, tid); threads gone meanwhile are left out."""
    out = {}
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            base = f"/proc/{pid}/task/{tid}"
            try:
                run_ns, wait_ns, _ = map(int, Path(f"{base}/schedstat").read_text().split())
                stat = Path(f"{base}/stat").read_text()
            except (OSError, ValueError):
                continue
            name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
            # after the name: state (0), ..., minflt (7), majflt (9), ..., processor (36)
            out[pid, tid] = ThreadTimes(name, run_ns, wait_ns, int(rest[7]), int(rest[9]), int(rest[36]))
    return out


def where_the_time_went(before: dict, after: dict, span_s: float, top: int = 6) -> list[str]:
    """Per process, its busiest threads over ``span_s`` between two ``thread_times``: seconds on a CPU, in the
    run queue, asleep (the rest), page faults, and the CPU last run on."""
    lines = []
    for pid in sorted({pid for pid, _ in after}):
        rows = []
        for (p, tid), now in after.items():
            then = before.get((p, tid))
            if p != pid or then is None:
                continue
            run, wait = (now.run_ns - then.run_ns) / 1e9, (now.wait_ns - then.wait_ns) / 1e9
            rows.append(
                (run + wait, tid, now, run, wait, now.faults - then.faults, now.major_faults - then.major_faults)
            )
        rows.sort(reverse=True)
        for _, tid, now, run, wait, faults, major in rows[:top]:
            asleep = max(0.0, span_s - run - wait)
            lines.append(
                f"pid {pid} tid {tid} {now.name!r}: on a CPU {run:.2f}s, run queue {wait:.2f}s, asleep {asleep:.2f}s "
                f"of {span_s:.2f}s; faults {faults} ({major} major); last on CPU {now.cpu}"
            )
    return lines


def dump(port: int, pids: list[int], out: Path, note: str, native: bool, times: Sequence[str] = ()) -> Path:
    """``pids`` (``family``: the API server first) dumped into a new file of ``out``, the worker first."""
    path = out / f"stall-{port}-{time.strftime('%H%M%S')}.txt"
    with path.open("w") as f:
        f.write(f"{note}\n")
        if times:
            f.write("\nwhere the engine's threads spent the stall (kernel accounting):\n" + "\n".join(times) + "\n")
        for p in reversed(pids):  # the worker, then the engine core, then the API server
            command = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:200]
            f.write(f"\n===== pid {p}: {command!r}\n")
            f.flush()
            command = [PY_SPY, "dump", "--pid", str(p)] + (["--native"] if native else [])
            subprocess.run(command, stdout=f, stderr=subprocess.STDOUT)
    return path


class Processes:
    """An engine's processes by its port (``listener_pid``, ``family``), looked up again every ``FAMILY_S``: the
    watcher reads them every second and must not spawn ``ss`` and ``ps`` as often on a machine it measures."""

    def __init__(self) -> None:
        self._found: dict[int, tuple[float, list[int]]] = {}

    def of(self, port: int, now: float) -> list[int]:
        when, pids = self._found.get(port, (-float("inf"), []))
        if now - when >= FAMILY_S:
            pid = listener_pid(port)
            pids = family(pid) if pid else []
            self._found[port] = (now, pids)
        return pids


def engine_ports(spec: ClusterSpec) -> list[int]:
    """The HTTP port of every engine the spec's pools may grow to (``PoolSpec.ports``)."""
    return [port for role in ROLES for port in spec.pool(role).ports(spec.max_replicas(role))]


class Stalls:
    """Which engines stall: an engine's steps standing still for ``stall_s`` while it has requests running. A
    stall is due a dump at once, then every ``every_s`` while it lasts, ``dumps`` times at most."""

    def __init__(self, stall_s: float, every_s: float, dumps: int) -> None:
        self.stall_s, self.every_s, self.dumps = stall_s, every_s, dumps
        self._moved: dict[int, tuple[float, float]] = {}  # port -> (steps, when they last moved)
        self._dumped: dict[int, tuple[int, float]] = {}  # port -> (dumps of this stall, when the last was)

    def due(self, port: int, reading: tuple[float, float] | None, now: float) -> float | None:
        """Seconds the engine on ``port`` has stood still if a dump is due now, else None; ``reading``:
        ``read_metrics``' (running, steps), None where the engine did not answer."""
        if reading is None:
            self._moved.pop(port, None)
            return None
        running, steps = reading
        last = self._moved.get(port)
        if last is None or steps != last[0] or running == 0:
            self._moved[port] = (steps, now)
            self._dumped.pop(port, None)
            return None
        still = now - last[1]
        count, when = self._dumped.get(port, (0, -float("inf")))
        if still < self.stall_s or count >= self.dumps or now - when < self.every_s:
            return None
        self._dumped[port] = (count + 1, now)
        return still

    def moved_at(self, port: int) -> float | None:
        """When the engine on ``port`` last stepped (or came back, or had nothing running); None: not seen."""
        last = self._moved.get(port)
        return None if last is None else last[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stall-s", type=float, default=4.0)
    parser.add_argument("--for-s", type=float, default=900.0)
    parser.add_argument("--every-s", type=float, default=2.0)
    parser.add_argument("--dumps", type=int, default=3)
    parser.add_argument("--native", action="store_true")
    parser.add_argument("--config", default="configs/local-cpu-autoscale.yaml", help="the cluster's spec")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ports = engine_ports(ClusterSpec.from_file(args.config))
    stalls = Stalls(args.stall_s, args.every_s, args.dumps)
    moved: dict[int, tuple[float, dict]] = {}  # port -> (when its steps last moved, thread_times then)
    processes = Processes()
    end = time.monotonic() + args.for_s
    while time.monotonic() < end:
        for port in ports:
            reading = read_metrics(port)
            now = time.monotonic()
            still = stalls.due(port, reading, now)
            since = stalls.moved_at(port)
            if reading is None or reading[0] == 0 or since is None:  # gone or idle: nothing to stall
                moved.pop(port, None)
                continue
            if port not in moved or moved[port][0] != since:  # it stepped: the accounting starts again here
                moved[port] = (since, thread_times(processes.of(port, now)))
            if still is not None:
                pids = processes.of(port, now)
                times = where_the_time_went(moved[port][1], thread_times(pids), now - since)
                note = f"port {port}: {reading[0]:.0f} running, steps at {reading[1]:.0f} for {still:.1f}s"
                path = dump(port, pids, args.out, note, args.native, times)
                print(f"{time.strftime('%H:%M:%S')} stall on port {port}: {path}", flush=True)
        time.sleep(POLL_S)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
