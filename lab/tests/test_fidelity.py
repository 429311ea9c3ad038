"""testlib/fidelity.py: the cluster-against-simulator comparison (its replay runs in
tests/integration/test_profile.py) and the mean of the profiles before and after a replay
(tests: test_validate_simulator.py)."""

from __future__ import annotations

import pytest

from orchestrator.autoscale import traces
from testlib import fidelity
from testlib.profiles import make_profile


def test_fidelity_compares_quantiles_and_judges_the_tolerance():
    from types import SimpleNamespace

    measured = [{"ttft_s": float(i), "itl_s": 0.1} for i in range(1, 11)]
    simulated = [SimpleNamespace(ttft_s=1.1 * i, itl_s=0.125) for i in range(1, 11)]

    rows = fidelity.compare(measured, simulated)

    assert list(rows) == ["TTFT p50", "TTFT p90", "ITL p50", "ITL p90"]
    assert rows["TTFT p50"] == {"cluster_s": 6.0, "simulator_s": 6.6, "ratio": 1.1}
    assert rows["TTFT p90"]["cluster_s"] == 10.0 and rows["ITL p90"]["ratio"] == 1.25
    assert not fidelity.within(rows)  # ITL 25 % over
    assert fidelity.within(rows, tolerance=0.25)


def test_fidelity_capacity_is_engines_over_the_mixes_mean_prefill_time():
    profile = make_profile(prefill_s_per_token=0.002)
    mix = traces.LengthMix("fixed", ((1.0, traces.LengthDist(250, 0.0, 250, 250), traces.LengthDist(8, 0.0, 8, 8)),))

    assert fidelity.prefill_capacity_rps(profile, 1, mix) == pytest.approx(2.0)  # 0.5 s per prompt
    assert fidelity.prefill_capacity_rps(profile, 3, mix) == pytest.approx(6.0)


def test_fidelity_decode_capacity_is_a_full_batchs_tokens_over_the_mixes_mean_answer():
    profile = make_profile(decode_step=(0.1, 0.0), max_num_seqs=4)  # 4 sequences a step of 0.1 s: 40 tokens/s
    mix = traces.LengthMix("fixed", ((1.0, traces.LengthDist(250, 0.0, 250, 250), traces.LengthDist(8, 0.0, 8, 8)),))

    assert fidelity.decode_capacity_rps(profile, mix) == pytest.approx(40.0 / 8)


def test_a_watcher_held_still_is_a_stall_and_requests_near_it_are_left_out():
    import signal
    import time

    import psutil

    before = {child.pid for child in psutil.Process().children()}  # an xdist worker may hold others
    with fidelity.client_stalls() as stalls:
        time.sleep(0.3)  # the watcher has started
        (watcher,) = [child for child in psutil.Process().children() if child.pid not in before]
        held = time.time()
        watcher.send_signal(signal.SIGSTOP)  # as a process that gets no CPU
        time.sleep(0.6)
        watcher.send_signal(signal.SIGCONT)
        time.sleep(0.2)
    ((start, end),) = stalls
    assert start <= held + 0.05 and end - start >= 0.5

    answers = [
        {"sent_at": start - 3, "ended_at": start - 2},  # before: kept
        {"sent_at": start - 1, "ended_at": start + 0.1},  # through it
        {"sent_at": end + 1, "ended_at": end + 2},  # in the backlog it left (SETTLE_S)
        {"sent_at": end + fidelity.SETTLE_S + 0.1, "ended_at": end + 4},  # after: kept
        {"failed": "URLError"},
    ]
    assert fidelity.undisturbed(answers, stalls) == [0, 3]
    assert fidelity.undisturbed(answers, []) == [0, 1, 2, 3]


def test_a_replay_apart_streams_every_request_from_a_process_of_its_own():
    import http.server
    import threading

    class Stream(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("X-PDServe-Path", "disaggregated")
            self.end_headers()
            for _ in range(3):
                self.wfile.write(b'data: {"choices": [{"text": "x"}]}\n\n')
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        trace = [traces.TraceRequest(0.0, 8, 3), traces.TraceRequest(0.1, 8, 3)]
        answers, stalls = fidelity.replay_apart(f"http://127.0.0.1:{server.server_port}", "m", trace)
    finally:
        server.shutdown()
    assert [(a["chunks"], a["path"]) for a in answers] == [(3, "disaggregated")] * 2
    assert all(a["sent_at"] <= a["ended_at"] for a in answers) and isinstance(stalls, list)


def test_a_replay_sends_each_request_at_its_time_however_many_are_in_flight():
    import http.server
    import threading

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'data: {"choices": [{"text": "x"}]}\n\n')
            self.wfile.flush()
            threading.Event().wait(1.5)  # an answer that takes long: every request is in flight at once
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    class Server(http.server.ThreadingHTTPServer):
        request_queue_size = 256  # its listen backlog: 150 connections at once

    server = Server(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:  # 150 requests in 0.3 s: a pool of 64 threads sent the 65th 1.5 s late, and timed its TTFT from then
        trace = [traces.TraceRequest(0.2 + i * 0.002, 8, 2) for i in range(150)]
        answers = fidelity.replay(f"http://127.0.0.1:{server.server_port}", "m", trace)
    finally:
        server.shutdown()
    assert all("failed" not in a for a in answers), [a for a in answers if "failed" in a][:3]
    assert max(a["late_s"] for a in answers) < 0.5
    assert max(a["ttft_s"] for a in answers) < 0.5
