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


def test_a_stall_is_steps_standing_still_with_requests_running_dumped_a_few_times_apart() -> None:
    stalls = stall_watch.Stalls(stall_s=4.0, every_s=2.0, dumps=2)
    assert stalls.due(8200, (21.0, 5310.0), 0.0) is None  # first seen
    assert stalls.due(8200, (21.0, 5310.0), 3.9) is None  # not yet
    assert stalls.due(8200, (21.0, 5310.0), 4.0) == 4.0  # a stall: dump
    assert stalls.due(8200, (21.0, 5310.0), 5.0) is None  # the next one every 2 s
    assert stalls.due(8200, (21.0, 5310.0), 6.0) == 6.0
    assert stalls.due(8200, (21.0, 5310.0), 9.0) is None  # at most 2 per stall
    assert stalls.due(8200, (21.0, 5311.0), 10.0) is None  # it stepped: a new stall counts afresh
    assert stalls.due(8200, (21.0, 5311.0), 14.0) == 4.0
    # an idle engine, or one that does not answer, never stalls
    assert stalls.due(8100, (0.0, 7.0), 0.0) is None and stalls.due(8100, (0.0, 7.0), 30.0) is None
    assert stalls.due(8101, None, 0.0) is None


def test_it_watches_every_engine_the_pools_may_grow_to() -> None:
    from orchestrator.spec import ClusterSpec

    spec = ClusterSpec.from_file("configs/local-cpu-autoscale.yaml")
    assert stall_watch.engine_ports(spec) == [8100, 8101, 8200, 8201]
