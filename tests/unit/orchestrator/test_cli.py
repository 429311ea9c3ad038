"""``pdserve validate``: what a user sees for a good and a bad spec file."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli import main


def test_validate_shipped_spec_prints_the_planned_engines(local_cpu_spec: Path, capsys):
    assert main(["validate", str(local_cpu_spec)]) == 0

    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == (
        f"{local_cpu_spec}: valid: cluster 'local-cpu', model 'smollm2-135m-instruct', connector pdserve"
    )
    assert lines[1:7] == [
        "  on Ray head node:",
        "    proxy, controller",
        "  on any node:",
        "    prefill-0  cores 0, port 8100, kv_port 5600",
        "    decode-0   cores 1, port 8200, kv_port 5700",
        "  proxy      listens on 127.0.0.1:8000",
    ]
    assert err == ""


def test_validate_lists_every_replica(write_spec, make_spec, capsys):
    path = write_spec(make_spec(prefill={"replicas": 2}, served_model_name="smol"))

    assert main(["validate", str(path)]) == 0

    out = capsys.readouterr().out
    assert "model 'smol'" in out
    engines = [line.split()[0] for line in out.splitlines() if line.startswith("    ") and "port" in line]
    assert engines == ["prefill-0", "prefill-1", "decode-0"]


def test_validate_cuda_spec_shows_gpus_instead_of_cores(write_spec, make_spec, capsys):
    path = write_spec(make_spec(device="cuda", prefill={"tensor_parallel_size": 2}, resources={"gpus": 3}))

    assert main(["validate", str(path)]) == 0

    lines = capsys.readouterr().out.splitlines()
    assert lines[4].startswith("    prefill-0  2 GPU(s) in one placement group")
    assert lines[5].startswith("    decode-0   1 GPU(s) in one placement group")


def test_validate_invalid_spec_exits_2_naming_file_and_field(write_spec, make_spec, capsys):
    path = write_spec(make_spec(prefill={"replicas": 0}))

    assert main(["validate", str(path)]) == 2

    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        "pdserve: invalid spec:",
        f"{path}: prefill.replicas: Input should be greater than or equal to 1 (got 0)",
    ]


def test_validate_prints_every_problem(write_spec, make_spec, capsys):
    path = write_spec(make_spec(modle="typo", decode={"replica": 2}))

    assert main(["validate", str(path)]) == 2

    err = capsys.readouterr().err
    assert f"{path}: modle: unknown key" in err
    assert f"{path}: decode.replica: unknown key" in err


def test_validate_missing_file_exits_2(tmp_path: Path, capsys):
    missing = tmp_path / "missing.yaml"

    assert main(["validate", str(missing)]) == 2

    assert f"{missing}: cannot read file" in capsys.readouterr().err


def test_validate_needs_a_path(capsys):
    with pytest.raises(SystemExit) as info:
        main(["validate"])

    assert info.value.code == 2
    assert "config" in capsys.readouterr().err


def test_validate_says_whether_the_autoscaler_runs_and_names_a_bad_profile(write_spec, make_spec, capsys, tmp_path):
    scaling = {
        "prefill": {"min": 1, "max": 2},
        "decode": {"min": 1, "max": 1},
        "max_engines": 3,
        "targets": {"ttft_p90_s": 4, "itl_p90_s": 1},
    }
    off = write_spec(make_spec(autoscaling=scaling, resources={"share_cores": True}))
    assert main(["validate", str(off)]) == 0
    assert "autoscaler off (no autoscaling.profile); prefill 1..2, decode 1..1" in capsys.readouterr().out

    profile = Path("configs/profiles/example-gpu.yaml").resolve()
    on = write_spec(make_spec(autoscaling=scaling | {"profile": str(profile)}, resources={"share_cores": True}))
    assert main(["validate", str(on)]) == 0
    assert f"autoscaler on, profile {profile}" in capsys.readouterr().out

    (tmp_path / "bad.yaml").write_text("format: pdserve-profile/0\n")
    bad = write_spec(
        make_spec(autoscaling=scaling | {"profile": str(tmp_path / "bad.yaml")}, resources={"share_cores": True})
    )
    assert main(["validate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve: {bad}: autoscaling.profile: {tmp_path / 'bad.yaml'}: format")


def test_status_shows_the_autoscalers_last_decisions_and_why(monkeypatch, capsys):
    from orchestrator import cluster

    decision = {
        "t": 0.0,
        "prefill": 2,
        "decode": 1,
        "changed": {"prefill": [1, 2]},
        "observed": {"arrival_rps": 0.5, "ttft_p90_s": 3.2, "itl_p90_s": 0.14},
        "reasons": ["prefill: 0.50 req/s x 262 tokens ... needs 2", "prefill: 1 -> 2"],
    }
    status = {
        "name": "c", "phase": "ready", "ready_s": 50.0, "model": "m", "connector": "pdserve",
        "proxy_url": "http://127.0.0.1:8000", "log_dir": "/tmp/logs", "error": None, "engines": [],
        "pools": {"prefill": {"target": 2, "max": 2, "ready": 1, "draining": 0}},
        "autoscaler": {"interval_s": 5, "decisions": [decision], "changes": [decision]},
    }  # fmt: skip
    monkeypatch.setattr(cluster, "status", lambda: status)
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "autoscaler: a decision every 5s; the last 1 of 1:" in out
    assert "prefill 2 decode 1 (prefill 1->2); saw 0.50 req/s, p90 TTFT 3.20s, p90 ITL 140ms" in out
    assert "      prefill: 0.50 req/s x 262 tokens ... needs 2" in out
    assert "autoscaler changes: " in out and out.rstrip().endswith("prefill 1->2")


def test_status_names_an_engine_with_quarantined_kv_blocks_and_only_such_an_engine(monkeypatch, capsys):
    from orchestrator import cluster

    def engine(engine_id: str, blocks: int | None) -> dict:
        return {"engine_id": engine_id, "role": "decode", "state": "ready", "url": "http://127.0.0.1:8200",
                "cpu_bind": "0", "load_s": 30.0, "restarts": 0, "kv_quarantined_blocks": blocks}  # fmt: skip

    status = {
        "name": "c", "phase": "ready", "ready_s": 50.0, "model": "m", "connector": "pdserve",
        "proxy_url": "http://127.0.0.1:8000", "log_dir": "/tmp/logs", "error": None, "autoscaler": None,
        "pools": {"decode": {"target": 3, "max": 3, "ready": 3, "draining": 0}},
        "engines": [engine("decode-0", 0), engine("decode-1", 12), engine("decode-2", None)],
    }  # fmt: skip
    monkeypatch.setattr(cluster, "status", lambda: status)

    assert main(["status"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "quarantined" in line]
    assert lines == [
        "decode-1 has 12 KV block(s) quarantined: an aborted KV read may still land in them, so they are out of "
        "use until the engine restarts"
    ]

    status["engines"] = [engine("decode-0", 0), engine("decode-2", None)]
    assert main(["status"]) == 0
    assert "quarantined" not in capsys.readouterr().out


def test_a_second_up_while_one_is_starting_is_refused_and_touches_nothing(
    local_cpu_spec: Path, monkeypatch, tmp_path: Path, capsys
):
    import subprocess
    import sys

    monkeypatch.setenv("PDSERVE_STATE_DIR", str(tmp_path))
    (tmp_path / "cluster.json").write_text("{}")  # the first one's records, not yet alive
    hold = (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
        "f.write('pid 4242'); f.flush(); print('held', flush=True); time.sleep(60)"
    )
    first = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / "up.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        assert main(["up", str(local_cpu_spec), "--detach"]) == 1
    finally:
        first.kill()
        first.wait()
    err = capsys.readouterr().err
    assert f"another `pdserve up` (pid 4242) is starting a cluster from {tmp_path}" in err
    assert (tmp_path / "cluster.json").read_text() == "{}"


def test_up_takes_the_secret_it_is_given_else_makes_a_new_one(tmp_path: Path):
    """Engines and a proxy started by hand share a cluster's secret when ``pdserve up`` is given it."""
    from contract.auth import SECRET_ENV, SECRET_FILE_ENV, ClusterSecret, new_secret, write_secret
    from orchestrator.state import secret_for_up

    given = new_secret()
    write_secret(tmp_path / "cluster-secret", given)
    assert secret_for_up({SECRET_FILE_ENV: str(tmp_path / "cluster-secret")}) == given
    assert secret_for_up({SECRET_ENV: given.reveal()}) == given
    fresh = [secret_for_up({}) for _ in range(2)]
    assert fresh[0] != fresh[1] and isinstance(fresh[0], ClusterSecret)
    assert fresh[0] != given
