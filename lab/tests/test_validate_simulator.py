"""lab/validate_simulator.py's own logic: the probe's slowdowns it reads, the per-request rows it saves,
and the by-minute view of them (the cluster side runs in tests/integration/test_profile.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

import pytest

from lab import validate_simulator
from orchestrator.autoscale.sim_model import EVEN_SHARE, RequestRecord, SharedCore
from orchestrator.autoscale.traces import TraceRequest
from testlib.fidelity import latency_quantiles, mean_profile
from testlib.profiles import make_profile, poisson_trace


def test_the_probes_slowdowns_are_read_and_a_file_without_them_is_named(tmp_path: Path) -> None:
    assert validate_simulator.load_shared_core(None) is EVEN_SHARE
    probe, other = tmp_path / "probe.json", tmp_path / "other.json"
    probe.write_text(json.dumps({"shared_core": {"prefill": 1.9, "decode": 2.1, "startup": 1.8}}))
    assert validate_simulator.load_shared_core([str(probe)]) == SharedCore(1.9, 2.1, 1.8)
    other.write_text(json.dumps({"shared_core": {"prefill": 2.8, "decode": 3.0, "startup": 1.9}}))
    assert validate_simulator.load_shared_core([str(probe), str(other)]) == SharedCore(2.35, 2.55, 1.85)  # the mean
    newer = tmp_path / "newer.json"  # its start-up is over the start with the cluster: the older ones' is left out
    newer.write_text(
        json.dumps(
            {"prefill_1_startup_s": {"at_up": 30.0}, "shared_core": {"prefill": 2.2, "decode": 2.4, "startup": 2.5}}
        )
    )
    assert validate_simulator.load_shared_core([str(probe), str(other), str(newer)]) == SharedCore(2.3, 2.5, 2.5)
    host = tmp_path / "host.json"  # the host probe measures its own fields only: the others keep the core probes'
    host.write_text(json.dumps({"shared_core": {"host_prefill": 1.08, "host_decode": 1.04}}))
    assert validate_simulator.load_shared_core([str(probe), str(other), str(host)]) == SharedCore(
        2.35, 2.55, 1.85, host_prefill=1.08, host_decode=1.04
    )
    probe.write_text(json.dumps({"decode_slowdown": {}}))
    with pytest.raises(SystemExit, match=r"probe.json: no 'shared_core'"):
        validate_simulator.load_shared_core([str(other), str(probe)])
    probe.write_text(json.dumps({"shared_core": {"decode": 0.5}}))
    with pytest.raises(SystemExit, match=r"probe.json: shared_core: SharedCore.decode must be 1 or more"):
        validate_simulator.load_shared_core([str(probe)])


def test_per_request_rows_pair_each_request_with_its_replay_and_its_simulation(tmp_path: Path, capsys) -> None:
    trace = [TraceRequest(70.0, 300, 5), TraceRequest(10.0, 100, 4), TraceRequest(20.0, 200, 3)]
    replayed = [{"ttft_s": 3.0, "itl_s": 0.2}, {"failed": "HTTP 500"}, {"ttft_s": 50.0, "itl_s": 0.1}]
    simulated = [  # in the simulator's order: by completion
        RequestRecord(20.0, 200, 3, 2.0, 0.1, 22.2),
        RequestRecord(70.0, 300, 5, 1.0, 0.3, 72.2),
        RequestRecord(10.0, 100, 4, 0.5, 0.1, 10.8),
    ]
    rows = validate_simulator.per_request(trace, replayed, simulated)
    assert rows == [
        [10.0, 100, 4, None, None, 0.5, 0.1],
        [20.0, 200, 3, 50.0, 0.1, 2.0, 0.1],
        [70.0, 300, 5, 3.0, 0.2, 1.0, 0.3],
    ]

    report = tmp_path / "report.json"
    report.write_text(json.dumps({"loads": {"bursty": {"per_request": rows}}}))
    validate_simulator.by_minute(str(report))
    lines = capsys.readouterr().out.splitlines()
    # minute 0: two arrivals (the failed one has no cluster TTFT); the 200-token prompt's first token came
    # at 70 s in the cluster, at 22 s in the simulator; the 300-token one at 73 / 71 s
    assert lines[1].split(" | ") == ["    0", "   2", "50.0 / 2.0", "50.0 / 2.0", "0 / 5"]
    assert lines[2].split(" | ") == ["   60", "   1", "3.0 / 1.0", "3.0 / 1.0", "8 / 5"]


def test_engine_samples_by_minute_give_each_engines_rate_and_times(capsys) -> None:
    columns = ["t", "engine", "prompt_tokens", "prefill_s_sum", "prefill_s_count", "queue_s_sum", "waiting", "running"]
    columns.append("kv_usage")
    rows = [
        [5.0, "prefill-0", 0, 0.0, 0, 0.0, 0, 0, 0.0],
        [55.0, "prefill-0", 6000, 20.0, 20, 40.0, 3, 1, 0.1],
        [65.0, "prefill-0", 9000, 26.0, 30, 90.0, 7, 1, 0.3],
        [115.0, "prefill-0", 9000, 26.0, 30, 90.0, 0, 0, 0.0],
    ]
    validate_simulator.engines_by_minute({"columns": columns, "rows": rows})
    lines = capsys.readouterr().out.splitlines()
    # minute 0: 6000 tokens in 50 s, 20 prefills of 1 s that waited 2 s each; minute 1: from 55 s on,
    # 3000 tokens in 60 s, 10 prefills of 0.6 s that waited 5 s; most waiting 7, KV use (30 % + 0) / 2
    assert [cell.strip() for cell in lines[1].split("|")] == ["prefill-0", "0", "120", "1.00", "2.00", "3", "5.0%"]
    assert [cell.strip() for cell in lines[2].split("|")] == ["prefill-0", "60", "50", "0.60", "5.00", "7", "15.0%"]


def test_engine_samples_with_step_counters_add_steps_per_second_and_tokens_per_step(capsys) -> None:
    columns = ["t", "engine", "prompt_tokens", "prefill_s_sum", "prefill_s_count", "queue_s_sum", "steps"]
    columns += ["step_tokens", "waiting", "running", "kv_usage"]
    rows = [
        [0.0, "prefill-0", 0, 0.0, 0, 0.0, 0, 0, 0, 0, 0.0],
        [50.0, "prefill-0", 6000, 20.0, 20, 40.0, 10, 6000, 0, 0, 0.0],
    ]
    validate_simulator.engines_by_minute({"columns": columns, "rows": rows})
    lines = capsys.readouterr().out.splitlines()
    # 10 steps in 50 s, 600 tokens each
    assert lines[0].endswith("| steps / s | tokens / step")
    assert [cell.strip() for cell in lines[1].split("|")][-2:] == ["0.20", "600"]


def test_the_simulators_passes_by_minute_give_their_rate_size_and_time_per_request(capsys) -> None:
    columns = ["t", "engine", "passes", "tokens", "sequences", "seconds", "seconds_x_sequences"]
    rows = [[0, "prefill-0", 2, 3000, 3, 3.0, 5.0], [50, "prefill-0", 4, 1000, 5, 3.0, 3.0]]
    validate_simulator.passes_by_minute({"columns": columns, "rows": rows}, 60.0)
    lines = capsys.readouterr().out.splitlines()
    # 6 passes in the minute: 4000 tokens, 8 sequences, 6 s; requests weigh their pass: 8 s over 8
    assert [cell.strip() for cell in lines[1].split("|")] == ["prefill-0", "0", "0.10", "667", "1.33", "1.00", "1.00"]


def test_the_report_keeps_each_row_on_one_line_and_reads_back_the_same() -> None:
    report = {"loads": {"bursty": {"per_request": [[1.0, 10, 2, None, None, 0.5, 0.1]]}}, "note": ["a [ b ]", "c, d"]}
    text = validate_simulator.report_json(report)
    assert json.loads(text) == report
    assert "[1.0, 10, 2, null, null, 0.5, 0.1]" in text.splitlines()[4]
    assert '"c, d"' in text  # a string's brackets and commas are left as they are


def test_the_engines_run_at_the_mean_of_the_profiles_around_the_replay_and_the_drift_is_reported() -> None:
    before = make_profile(prefill_s_per_token=0.001, decode_step=(0.1, 0.01), startup_s=40.0)
    after = make_profile(prefill_s_per_token=0.002, decode_step=(0.2, 0.02), startup_s=60.0)
    mean = mean_profile(before, after, "around", "test")
    assert mean.decode_step_seconds(8, 100) == pytest.approx(1.5 * before.decode_step_seconds(8, 100))
    assert mean.prefill_seconds(1000) == pytest.approx(1.5)
    assert (mean.engine.startup_s, mean.engine.max_num_seqs) == (50.0, before.engine.max_num_seqs)
    drift = validate_simulator.drift(before, after)
    assert set(drift["decode_step"].values()) == {2.0} and set(drift["prefill_pass"].values()) == {2.0}
    assert drift["startup_s"] == [40.0, 60.0]


def test_the_autoscalers_phase_in_the_replay_comes_from_its_decisions_times() -> None:
    decisions = [{"t": 98.0}, {"t": 102.3}, {"t": 107.3}]  # every 5 s, at a fixed rate
    assert validate_simulator.decision_phase(decisions, 100.0, 5.0) == pytest.approx(2.3)
    assert validate_simulator.decision_phase([{"t": 105.0}], 100.0, 5.0) == 5.0  # on the start: one interval in
    assert validate_simulator.decision_phase([{"t": 98.0}], 100.0, 5.0) is None  # none during the replay
    assert validate_simulator.phases(5.0) == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_decisions_are_saved_as_rows_with_the_reasons_that_move_prefill() -> None:
    decisions = [
        {"t": -3.0, "prefill": 1, "decode": 1, "reasons": []},  # before the replay
        {
            "t": 2.5,
            "prefill": 2,
            "decode": 1,
            "arrival_rps": 1.6,
            "ttft_p90_s": 4.6,
            "prefill_waiting": 0,
            "decode_waiting": 1,
            "reasons": ["prefill: ... needs 2", "decode: ... needs 1", "feedback: measured p90 TTFT 4.6s > 4s"],
        },
    ]
    saved = validate_simulator.decision_rows(decisions)
    assert saved["columns"][-1] == "reasons"
    assert saved["rows"] == [
        [2.5, 2, 1, 1.6, 4.6, 0, 1, ["prefill: ... needs 2", "feedback: measured p90 TTFT 4.6s > 4s"]]
    ]


def _saved_report(tmp_path: Path, core_plan: str) -> str:
    """A report of the CPU autoscale demo replaying a steady load, as --resimulate reads it."""
    profile = "lab/results/autoscale-fidelity-cold-profile.yaml"  # the demo's engines, measured
    trace = poisson_trace(2.0, 200, lambda rng: rng.randint(50, 300), lambda rng: rng.randint(10, 60))
    report = tmp_path / "report.json"
    rows = [[r.t, r.prompt_tokens, r.output_tokens] for r in trace]
    report.write_text(
        json.dumps(
            {
                "config": "configs/local-cpu-autoscale.yaml",
                "profile": f"{profile} (measured in this run)",
                "routing": ["least_loaded", "round_robin"],
                "core_plan": core_plan,
                "loads": {"steady": {"requests": len(rows), "per_request": rows}},
            }
        )
    )
    return str(report)


def test_sensitivity_gives_how_much_each_quantile_moves_with_each_slowdown_beside_a_busy_engine(tmp_path) -> None:
    # prefill-0 and decode-0 on one core: a decode step beside a prefill pass takes SharedCore.decode times
    # its time alone, so ITL moves with that slowdown and not with a pass's own
    shared = SharedCore()
    run = validate_simulator.saved_run(_saved_report(tmp_path, "prefill-0:0 decode-0:0"), None, 7, 600.0)
    elasticity = validate_simulator.sensitivity(run, shared, 0.05)["steady"]
    assert list(elasticity) == ["prefill", "decode"]  # decode_beside_decode not given: it moves with decode
    assert list(elasticity["decode"]) == ["TTFT p50", "TTFT p90", "ITL p50", "ITL p90"]
    assert elasticity["decode"]["ITL p50"] > 0.1
    # the figure is the quantile's change in logs over the input's, from the simulator run at both ends
    low, high = (
        latency_quantiles(run.predict("steady", dataclasses.replace(shared, decode=2.0 * f)).records)
        for f in (0.95, 1.05)
    )
    span = math.log(1.05 / 0.95)
    assert elasticity["decode"]["ITL p90"] == pytest.approx(math.log(high["ITL p90"] / low["ITL p90"]) / span, abs=0.01)
    given = validate_simulator.sensitivity(run, SharedCore(decode_beside_decode=2.0), 0.05)["steady"]
    assert list(given) == ["prefill", "decode", "decode_beside_decode"]  # given: varied on its own
    # each engine on a core of its own: no slowdown applies, nothing moves
    alone = validate_simulator.saved_run(_saved_report(tmp_path, "prefill-0:0 decode-0:1"), None, 7, 600.0)
    assert all(
        e == 0.0
        for field in validate_simulator.sensitivity(alone, shared, 0.05)["steady"].values()
        for e in field.values()
    )


def test_the_clusters_busy_decode_steps_are_read_against_the_profiles_step_alone(tmp_path) -> None:
    report_path = _saved_report(tmp_path, "prefill-0:0 decode-0:0")
    report = json.loads(Path(report_path).read_text())
    columns = ["t", "engine", "steps", "running"]
    report["engine_samples"] = {
        "columns": columns,
        "rows": [
            [60.0, "decode-0", 0, 20],
            [65.0, "decode-0", 25, 20],  # 25 steps in 5 s with 20 running at both readings: 0.2 s a step
            [70.0, "decode-0", 50, 10],  # 10 running: not busy, left out
            [75.0, "decode-0", 60, 30],
        ],
    }
    Path(report_path).write_text(json.dumps(report))
    run = validate_simulator.saved_run(report_path, None, 7, 600.0)
    recent = [r for r in run.traces["steady"] if 5.0 <= r.t < 65.0]
    outputs = sum(r.output_tokens for r in recent)
    context = statistics.mean(r.prompt_tokens for r in recent) + sum(r.output_tokens**2 for r in recent) / 2 / outputs
    assert validate_simulator.decode_slowdowns(run) == [
        pytest.approx(0.2 / run.physics.decode_step_seconds(20, context))
    ]
    del report["engine_samples"]  # a report without readings has none
    Path(report_path).write_text(json.dumps(report))
    assert validate_simulator.decode_slowdowns(validate_simulator.saved_run(report_path, None, 7, 600.0)) == []
