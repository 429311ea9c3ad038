"""A soak with abandoned streams: does every prefill lease end read or released, none expired?

Starts the demo cluster of ``--config`` with a short lease (``--lease-ttl-s``, so an expiry shows within the
run) in a state directory of its own, runs ``--clients`` clients for ``--seconds`` that stream chat
completions through the proxy, and lets a ``--abandon`` share of the streams go after their first few
chunks (the client closes its socket, as a user who leaves does). Then it waits a lease's life and reads
the prefill engine's ``pdserve:kv_leases_total{outcome}``: every lease a request took should have ended
``read`` (the decode engine read it) or ``released`` (nobody would), and none ``expired`` (held for its whole
lease by a request that was gone). Prints one JSON line; exits 1 if a lease expired.

    python scripts/soak_abandon.py [--config configs/local-cpu.yaml] [--seconds 180] [--clients 16]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PDSERVE = [sys.executable, "-m", "orchestrator.cli"]
MODEL = "smollm2-135m-instruct"
LEASES = "pdserve:kv_leases_total"


def leases(engine_url: str) -> dict[str, float]:
    with urllib.request.urlopen(engine_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(LEASES + "{") and 'outcome="' in line:
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            counts[outcome] = counts.get(outcome, 0) + float(line.rsplit(" ", 1)[1])
    return counts


def stream(proxy: str, prompt: str, abandon_after: int | None, max_tokens: int) -> str:
    """One streamed chat request: 'done', 'abandoned' or 'failed <status>'."""
    host, port = proxy.removeprefix("http://").split(":")
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True}  # fmt: skip
    connection = http.client.HTTPConnection(host, int(port), timeout=300)
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            return f"failed {response.status}"
        chunks = 0
        for line in response:
            if line.startswith(b"data: "):
                chunks += 1
                if abandon_after is not None and chunks >= abandon_after:
                    connection.sock.close()  # the user leaves
                    return "abandoned"
        return "done"
    except OSError as e:
        return f"failed {type(e).__name__}"
    finally:
        connection.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/local-cpu.yaml")
    parser.add_argument("--seconds", type=float, default=180)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--abandon", type=float, default=0.2, help="share of streams abandoned (default: 0.2)")
    parser.add_argument("--lease-ttl-s", type=float, default=30)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    spec = yaml.safe_load(Path(args.config).read_text())
    spec.setdefault("connector_options", {})["lease_ttl_s"] = args.lease_ttl_s
    with tempfile.TemporaryDirectory(prefix="pdserve-soak-") as root:
        spec_path = Path(root) / "cluster.yaml"
        spec_path.write_text(yaml.safe_dump(spec))
        env = dict(os.environ, PDSERVE_STATE_DIR=str(Path(root) / "state"))
        run = lambda *a: subprocess.run([*PDSERVE, *a], env=env, capture_output=True, text=True, timeout=900)  # noqa: E731
        up = run("up", str(spec_path), "--detach")
        if up.returncode:
            sys.exit(f"pdserve up failed: {up.stderr[-2000:]}")
        try:
            status = json.loads(run("status", "--json").stdout)
            proxy = status["proxy_url"]
            prefill = next(e["url"] for e in status["engines"] if e["role"] == "prefill")
            pids = {e["engine_id"]: e["pid"] for e in status["engines"]}
            before = leases(prefill)
            outcomes: list[str] = []
            stop = time.monotonic() + args.seconds

            def client(n: int) -> None:
                rng = random.Random(n)
                i = 0
                while time.monotonic() < stop:
                    abandon = rng.randint(1, 4) if rng.random() < args.abandon else None
                    outcomes.append(stream(proxy, f"Client {n}, question {i}: tell me about rivers.", abandon,
                                           args.max_tokens))  # fmt: skip
                    i += 1

            threads = [threading.Thread(target=client, args=(n,)) for n in range(args.clients)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            time.sleep(args.lease_ttl_s + 10)  # any lease still held now ends by expiry
            after = leases(prefill)
            status = json.loads(run("status", "--json").stdout)
            result = {
                "seconds": args.seconds,
                "clients": args.clients,
                "requests": {kind: outcomes.count(kind) for kind in sorted(set(outcomes))},
                "leases": {k: after.get(k, 0) - before.get(k, 0) for k in sorted(set(after) | set(before))},
                "same_engine_pids": {e["engine_id"]: e["pid"] for e in status["engines"]} == pids,
            }
        finally:
            run("down")
    print(json.dumps(result))
    return 1 if result["leases"].get("expired") else 0


if __name__ == "__main__":
    sys.exit(main())
