"""lab/stall_watch.py: what it reads off an engine's /metrics, and which processes it dumps."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time

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


def test_where_a_stalls_time_went_is_each_threads_cpu_run_queue_and_sleep_from_the_kernel() -> None:
    pid, tid = os.getpid(), threading.get_native_id()
    before = stall_watch.thread_times([pid])
    assert (pid, tid) in before and before[pid, tid].run_ns > 0
    started = time.monotonic()
    while time.monotonic() - started < 0.3:  # on a CPU
        pass
    time.sleep(0.3)  # asleep
    span = time.monotonic() - started
    lines = stall_watch.where_the_time_went(before, stall_watch.thread_times([pid]), span)
    mine = next(line for line in lines if f"tid {tid} " in line)
    on_cpu = float(mine.split("on a CPU ")[1].split("s,")[0])
    asleep = float(mine.split("asleep ")[1].split("s ")[0])
    assert 0.1 <= on_cpu <= 0.45 and asleep >= 0.25
    assert stall_watch.thread_times([2**22 + 7]) == {}  # a process gone: nothing, no error


def test_an_engines_processes_are_looked_up_again_only_now_and_then(monkeypatch) -> None:
    looked = []
    monkeypatch.setattr(stall_watch, "listener_pid", lambda port: looked.append(port) or 4242)
    monkeypatch.setattr(stall_watch, "family", lambda pid: [pid, pid + 1])
    processes = stall_watch.Processes()
    assert processes.of(8200, 0.0) == [4242, 4243]
    assert processes.of(8200, stall_watch.FAMILY_S - 1) == [4242, 4243] and looked == [8200]
    processes.of(8200, stall_watch.FAMILY_S)
    assert looked == [8200, 8200]


def test_a_stall_counts_from_when_the_steps_last_moved() -> None:
    stalls = stall_watch.Stalls(stall_s=4.0, every_s=2.0, dumps=2)
    assert stalls.moved_at(8200) is None  # not seen
    stalls.due(8200, (21.0, 5310.0), 1.0)
    stalls.due(8200, (21.0, 5310.0), 3.0)  # standing still: still from 1 s
    assert stalls.moved_at(8200) == 1.0
    stalls.due(8200, (21.0, 5311.0), 6.0)
    assert stalls.moved_at(8200) == 6.0
    stalls.due(8200, None, 7.0)  # gone
    assert stalls.moved_at(8200) is None
