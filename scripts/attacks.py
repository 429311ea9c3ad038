"""What an attacker on the network gets from a running cluster: one row per attack class, measured.

Runs each attack against the cluster whose state directory is ``PDSERVE_STATE_DIR`` (what ``pdserve up``
wrote: its status and its secret), then looks where a user would: the HTTP status the attacker got,
whether every engine is still the same process (none died and was restarted), and how the next request's
prompt KV got to the decode engine (``X-PDServe-KV``). Run it against a cluster of an older commit to get
the "before" column (``git worktree add /tmp/base <commit>`` and start that tree's cluster with
``PYTHONPATH=/tmp/base``).

    PDSERVE_STATE_DIR=... python scripts/attacks.py [--json]

Only loopback and the cluster's own addresses are contacted. Attacks that change a cluster for good (a
scale, a sleep) are not sent.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from contract.auth import KVAuth, engine_key, read_secret_file  # noqa: E402
from contract.framing import MAX_FRAME_BYTES, FramingError, frame, recv_frame  # noqa: E402
from contract.headers import KV as KV_HEADER  # noqa: E402
from contract.wire import parse_tcp_endpoint  # noqa: E402

MODEL = "smollm2-135m-instruct"
KILLER = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r", "remote_host": "127.0.0.1",
          "remote_port": 1, "remote_block_ids": 5}  # fmt: skip
# vLLM 0.32's routes outside /v1 that reach its handlers (shared/ENVIRONMENT.md), read-only ones only
OUTSIDE_V1 = [("POST", "/invocations"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/openapi.json"),
              ("GET", "/is_scaling_elastic_ep"), ("GET", "/kv_event_sources")]  # fmt: skip


def chat(prompt: str, **extra: Any) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": 4,
        **extra,
    }


def post(url: str, body: dict | None, headers: dict[str, str] | None = None, method: str = "POST") -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, dict(response.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)
    except OSError as e:
        return 0, {"error": str(e)}


def status(env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "status", "--json"], env=env, capture_output=True, text=True
    )
    return json.loads(out.stdout)


def pids(env: dict[str, str]) -> dict[str, int]:
    return {e["engine_id"]: e["pid"] for e in status(env)["engines"]}


def next_kv(proxy_url: str) -> str:
    """How the next request's prompt KV got to the decode engine (``X-PDServe-KV``)."""
    code, headers = post(proxy_url + "/v1/chat/completions", chat("Say hello."))
    value = {k.lower(): v for k, v in headers.items()}.get(KV_HEADER.lower(), "")
    return f"{code} {value.split(';')[0] if value else '-'}" + (
        f" ({value.split('reason=')[1].split(';')[0]})" if "reason=" in value else ""
    )


def side_channel_send(endpoint: str, data: bytes, timeout_ms: int = 10_000) -> tuple[str, float]:
    """Send ``data`` (framed messages, or any bytes) to a side channel on a fresh connection; the first 40
    characters of the first answer (or ``(no answer)``: dropped, or silent), and how long it took."""
    started = time.monotonic()
    try:
        with socket.create_connection(parse_tcp_endpoint(endpoint), timeout=timeout_ms / 1000) as sock:
            sock.sendall(data)
            answer = recv_frame(sock, MAX_FRAME_BYTES, started + timeout_ms / 1000)
        return answer[:40].decode(errors="replace"), time.monotonic() - started
    except (OSError, FramingError):
        return "(no answer)", time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    env = dict(os.environ)
    state = Path(env["PDSERVE_STATE_DIR"])
    secret = read_secret_file(state / "cluster-secret")
    key = {"Authorization": f"Bearer {engine_key(secret)}"}
    cluster = status(env)
    proxy = cluster["proxy_url"]
    engines = {e["role"]: e for e in cluster["engines"]}
    decode, prefill = engines["decode"], engines["prefill"]
    rows: list[dict[str, Any]] = []
    seen = {"pids": pids(env)}

    def healthy() -> bool:
        return all(post(e["url"] + "/health", None, method="GET")[0] == 200 for e in engines.values())

    def row(attack: str, got: str) -> None:
        """Record an attack's outcome; if it cost an engine, wait for the cluster to heal before the next."""
        time.sleep(3)  # an engine core that died is noticed within a second (the actor's watchdog)
        alive = "yes"
        if not healthy() or pids(env) != seen["pids"]:
            started = time.monotonic()
            while not (healthy() and next_kv(proxy).endswith("transfer")) and time.monotonic() - started < 300:
                time.sleep(2)
            alive = f"no: back after {time.monotonic() - started + 3:.0f} s"
            seen["pids"] = pids(env)
        rows.append({"attack": attack, "got": got, "engines alive": alive, "next request": next_kv(proxy)})
        if not args.json:
            print(" | ".join(str(v) for v in rows[-1].values()), flush=True)

    answered = [f"{m} {p}" for m, p in OUTSIDE_V1 if post(decode["url"] + p, {} if m == "POST" else None,
                                                             method=m)[0] not in (401, 0)]  # fmt: skip
    row("engine routes outside /v1 without the key", f"{len(answered)} of {len(OUTSIDE_V1)} answered")
    code, _ = post(decode["url"] + "/invocations", chat("Hi"))
    row("inference on /invocations without the key", str(code))
    code, _ = post(decode["url"] + "/invocations", chat("Hi", kv_transfer_params=KILLER))
    row("malformed kv_transfer_params, no key (/invocations)", str(code))
    code, _ = post(decode["url"] + "/v1/chat/completions", chat("Hi", kv_transfer_params=KILLER), headers=key)
    row("malformed kv_transfer_params with the engine key", str(code))
    code, _ = post(proxy + "/v1/chat/completions", chat("Hi", vllm_xargs={"kv_transfer_params": KILLER}))
    row("kv_transfer_params in vllm_xargs through the proxy", str(code))
    answer, _ = side_channel_send(prefill["kv_endpoints"][0], frame(b"a") + frame(b"b"))
    row("two-frame message to a prefill side channel", answer)
    junk = b"PDS1 release 9999999999999 " + b"0" * 64 + b" " + b"x" * (256 << 20)
    kv = KVAuth(secret)
    answer, took = side_channel_send(prefill["kv_endpoints"][0], frame(junk), timeout_ms=30_000)
    _, next_took = side_channel_send(prefill["kv_endpoints"][0], frame(kv.seal(b"handshake", b"nonce junk")))
    got = "dropped unread" if answer == "(no answer)" else f"{answer} after {took:.2f} s"
    row("256 MiB well-framed junk to a side channel", f"{got}; the next message answered in {next_took * 1e3:.0f} ms")
    answer, _ = side_channel_send(prefill["kv_endpoints"][0], frame(kv.seal(b"handshake", b"nonce junk")))
    row("sealed handshake with a junk payload", answer)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
