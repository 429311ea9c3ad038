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
        f"{local_cpu_spec}: valid: cluster 'local-cpu', model 'smollm2-135m-instruct', connector vllm-nixl"
    )
    assert lines[1].split() == ["prefill-0", "http://127.0.0.1:8100", "kv", "port", "5600", "cores", "0"]
    assert lines[2].split() == ["decode-0", "http://127.0.0.1:8200", "kv", "port", "5700", "cores", "1"]
    assert lines[3].split() == ["proxy", "http://127.0.0.1:8000"]
    assert err == ""


def test_validate_lists_every_replica(write_spec, make_spec, capsys):
    path = write_spec(make_spec(prefill={"replicas": 2}, served_model_name="smol"))

    assert main(["validate", str(path)]) == 0

    out = capsys.readouterr().out
    assert "model 'smol'" in out
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["prefill-0", "prefill-1", "decode-0", "proxy"]


def test_validate_cuda_spec_shows_gpus_instead_of_cores(write_spec, make_spec, capsys):
    path = write_spec(make_spec(device="cuda", prefill={"tensor_parallel_size": 2}, resources={"gpus": 3}))

    assert main(["validate", str(path)]) == 0

    lines = capsys.readouterr().out.splitlines()
    assert lines[1].endswith("2 GPU(s)") and lines[1].startswith("  prefill-0")
    assert lines[2].endswith("1 GPU(s)") and lines[2].startswith("  decode-0")


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
