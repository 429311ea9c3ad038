"""lab/stall_watch.py: what it reads off an engine's /metrics, and which processes it dumps."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading

from lab import stall_watch

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="m"} 21.0
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 5310.0
vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 22918.0
"""


def test_it_reads_the_requests_running_and_the_steps_and_none_where_nothing_answers() -> None:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(METRICS.encode())

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert stall_watch.read_metrics(server.server_port) == (21.0, 5310.0)
    finally:
        server.shutdown()
        server.server_close()
    assert stall_watch.read_metrics(server.server_port) is None


def test_an_engines_processes_are_its_api_server_and_every_descendant() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        found = stall_watch.family(os.getpid())
        assert found[0] == os.getpid() and child.pid in found
    finally:
        child.kill()
        child.wait()
