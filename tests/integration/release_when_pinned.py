"""The release of ``test_a_release_sent_while_the_kv_is_being_read_is_refused_and_the_read_served``, sent from a
process of a session of its own.

While a READ is held and waits, both engines spin their cores (vLLM steps without pause while a request waits
for KV, and its worker busy-waits for each step), and on this 2-core machine a process of the test's, or one
started then, waited 3-5 s for a CPU: longer than the READ is held after its pin. This one is started before the
request's legs, in a session of its own, and raises its own priority where it may (as root:
``/proc/self/autogroup``, nice). It reads the job (one JSON line) on stdin, polls the prefill engine's pin counter
and, when it passes ``pins_before``, sends the release to every endpoint; a line ``answered`` on stdin (the decode
leg answered first) stops it. It prints ``{"sent": bool, "answered": bool}``.
"""

from __future__ import annotations

import json
import select
import socket
import sys
import time

from connectors.side_messages import MAX_REPLY_BYTES
from contract.framing import frame, recv_frame
from contract.wire import parse_tcp_endpoint
from testlib.priority import run_ahead
from tests.integration.conftest import metric_values

LEASES = "pdserve:kv_leases_total"


def send_release(endpoint: str, message: bytes, timeout_s: float = 2.0) -> bool:
    """Whether the side channel at ``endpoint`` takes the sealed release ``message``: it answers ``OK``."""
    try:
        with socket.create_connection(parse_tcp_endpoint(endpoint), timeout=timeout_s) as sock:
            sock.sendall(frame(message))
            return recv_frame(sock, MAX_REPLY_BYTES, time.monotonic() + timeout_s) == b"OK"
    except (OSError, ValueError):  # unreachable, or an answer that is not one of our frames
        return False


def main() -> None:
    run_ahead()
    job = json.loads(sys.stdin.readline())
    deadline = time.monotonic() + job["deadline_s"]
    while time.monotonic() < deadline:
        if metric_values(job["prefill_url"], LEASES, "outcome").get("pinned", 0) > job["pins_before"]:
            message = job["message"].encode()
            answered = all(send_release(endpoint, message) for endpoint in job["endpoints"])
            print(json.dumps({"sent": True, "answered": answered}), flush=True)
            return
        if select.select([sys.stdin], [], [], 0.02)[0]:  # the decode leg answered: nothing was pinned
            break
    print(json.dumps({"sent": False, "answered": False}), flush=True)


if __name__ == "__main__":
    main()
