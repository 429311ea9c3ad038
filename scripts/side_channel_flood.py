"""What a hostile client can make a side channel hold, and wait: measured against a real ``SideChannelServer``.

The server runs in a process of its own (``--serve``), so its RSS is its own; each attack gets a fresh one,
whose peak RSS is reset (``/proc/<pid>/clear_refs``) after a warm-up ping. Three attacks:

- ``giant_announcement``: one connection announces a 1 GiB message and trickles its body (a byte per 10 ms).
- ``connections_of_1_mib``: 200 connections each announce 1 MiB and send all of it but 1 KiB, then trickle;
  a third party pings the channel throughout.
- ``flood``: one connection sends sealed valid pings as fast as it can (32 at a time), another well-framed
  junk, then a header the server refuses, again and again; a third party pings the channel throughout.

For each: the server process's RSS growth (peak minus before), the server's own ``buffered_high_water``, and
the third party's ping latencies. One JSON line on stdout.

    python scripts/side_channel_flood.py [--seconds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from connectors.side_channel import MAX_CONNECTIONS, SideChannelServer  # noqa: E402
from connectors.side_client import ping  # noqa: E402
from connectors.side_messages import MAX_REQUEST_BYTES  # noqa: E402
from connectors.topology import KVTopology  # noqa: E402
from contract.auth import SECRET_ENV, KVAuth  # noqa: E402
from contract.framing import HEADER_BYTES, MAGIC, frame, recv_frame  # noqa: E402


def serve(port: int) -> None:
    """The server process: a side channel on ``port``; ``stats`` on stdin prints its counters, EOF ends it."""
    topology = KVTopology(
        tp_size=1, tp_rank=0, total_num_kv_heads=4, block_size=16, layout="HN2D", head_dim=64,
        dtype="torch.bfloat16", num_layers=2,
    )  # fmt: skip
    channel = SideChannelServer("flood-target", "127.0.0.1", port, topology, b"{}", KVAuth.from_env())
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "stats":
            stats = {"buffered_high_water": channel.buffered_high_water, "refused": channel.refused.take()}
            print(json.dumps(stats), flush=True)
    channel.close()


class Target:
    """A server process for one attack."""

    def __init__(self, env: dict[str, str]) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(self.port)], env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.process.stdout is not None and self.process.stdout.readline().strip() == "ready"

    def status_kib(self, field: str) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise KeyError(field)

    def reset_peak(self) -> None:
        Path(f"/proc/{self.process.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS

    def stats(self) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("stats\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=10)


def header(length: int) -> bytes:
    return struct.pack(">4sI", MAGIC, length)


class Pinger:
    """Pings the channel every 20 ms from a thread of its own, a connection each, and keeps how long each took."""

    def __init__(self, endpoint: str, auth: KVAuth) -> None:
        self.took: list[float] = []
        self.failed = 0
        self._stop = threading.Event()

        def run() -> None:
            while not self._stop.wait(0.02):
                started = time.monotonic()
                if ping(endpoint, auth, timeout_s=2):
                    self.took.append(time.monotonic() - started)
                else:
                    self.failed += 1

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=5)
        took = sorted(self.took)
        if not took:
            return {"pings": 0, "failed": self.failed}
        return {
            "pings": len(took),
            "failed": self.failed,
            "p50_ms": round(took[len(took) // 2] * 1e3, 2),
            "p99_ms": round(took[min(len(took) - 1, int(len(took) * 0.99))] * 1e3, 2),
            "max_ms": round(took[-1] * 1e3, 2),
        }


def giant_announcement(target: Target, auth: KVAuth, seconds: float) -> dict[str, Any]:
    started = time.monotonic()
    sent = 0
    with socket.create_connection(("127.0.0.1", target.port), timeout=2) as sock:
        try:
            sock.sendall(header(1 << 30))
            while time.monotonic() - started < seconds:
                sock.sendall(b"x")
                sent += 1
                time.sleep(0.01)
            dropped_after_s = None
        except ConnectionError:
            dropped_after_s = round(time.monotonic() - started, 3)
    return {"announced_bytes": 1 << 30, "body_bytes_sent": sent, "dropped_after_s": dropped_after_s}


def connections_of_1_mib(target: Target, auth: KVAuth, seconds: float, count: int = 200) -> dict[str, Any]:
    body = memoryview(header(MAX_REQUEST_BYTES) + bytes(MAX_REQUEST_BYTES - 1024))
    pinger = Pinger(target.endpoint, auth)
    sockets: list[socket.socket] = []
    left: dict[socket.socket, memoryview] = {}
    dropped = 0
    started = time.monotonic()
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", target.port), timeout=2)
        sock.setblocking(False)
        sockets.append(sock)
        left[sock] = body
    while time.monotonic() - started < seconds:
        for sock in sockets:
            if sock not in left:
                continue
            try:
                if left[sock]:
                    left[sock] = left[sock][sock.send(left[sock]) :]
                else:
                    sock.send(b"\0")  # the trickle: never a whole message
            except BlockingIOError:
                pass
            except OSError:
                del left[sock]
                dropped += 1
        time.sleep(0.01)
    result = {"connections": count, "dropped_by_server": dropped, "third_party": pinger.stop()}
    for sock in sockets:
        sock.close()
    return result


def flood(target: Target, auth: KVAuth, seconds: float) -> dict[str, Any]:
    stop = threading.Event()
    answered = {"pings": 0, "junk": 0}

    def pings() -> None:
        batch = frame(auth.seal(b"ping", b"")) * 32
        with socket.create_connection(("127.0.0.1", target.port), timeout=5) as sock:
            while not stop.is_set():
                sock.sendall(batch)
                for _ in range(32):
                    recv_frame(sock, 1 << 16, time.monotonic() + 5)
                    answered["pings"] += 1

    def junk() -> None:
        rng = random.Random(7)
        while not stop.is_set():
            with socket.create_connection(("127.0.0.1", target.port), timeout=5) as sock:
                for _ in range(16):
                    sock.sendall(frame(rng.randbytes(512)))
                    recv_frame(sock, 1 << 16, time.monotonic() + 5)
                    answered["junk"] += 1
                sock.sendall(header(MAX_REQUEST_BYTES + 1))
                try:
                    sock.recv(1)
                except OSError:
                    pass

    floods = [threading.Thread(target=f, daemon=True) for f in (pings, junk)]
    for thread in floods:
        thread.start()
    time.sleep(0.2)
    pinger = Pinger(target.endpoint, auth)
    time.sleep(seconds)
    third_party = pinger.stop()
    stop.set()
    for thread in floods:
        thread.join(timeout=10)
    return {"flood_answered": answered, "third_party": third_party}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=3.0, help="how long each attack lasts")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    env = dict(os.environ, **{SECRET_ENV: secrets.token_hex(32)})
    auth = KVAuth.from_env(env)
    report: dict[str, Any] = {
        "max_connections": MAX_CONNECTIONS,
        "max_request_bytes": MAX_REQUEST_BYTES,
        "bound_bytes": MAX_CONNECTIONS * (HEADER_BYTES + MAX_REQUEST_BYTES),
    }
    for attack in (giant_announcement, connections_of_1_mib, flood):
        target = Target(env)
        try:
            if not ping(target.endpoint, auth, timeout_s=5):
                raise RuntimeError("the side channel does not answer")
            before = target.status_kib("VmRSS")
            target.reset_peak()
            result = attack(target, auth, args.seconds)
            stats = target.stats()
            result |= {
                "rss_before_mib": round(before / 1024, 1),
                "rss_growth_mib": round((target.status_kib("VmHWM") - before) / 1024, 1),
                "server_buffered_high_water_mib": round(stats["buffered_high_water"] / (1 << 20), 2),
                "server_refused": stats["refused"],
            }
            if not ping(target.endpoint, auth, timeout_s=5):
                result["serving_after"] = False
        finally:
            target.close()
        report[attack.__name__] = result
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
