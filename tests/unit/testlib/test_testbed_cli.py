"""The namespace test bed's pure parts (``testlib/testbed``) and its command line (``scripts/hosts.py``): host specs,
the flags ``up`` turns into the library's arguments, the errors; nothing here makes a namespace or starts Ray."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from testlib import testbed
from testlib.testbed import cli
from testlib.testbed.config import CLI  # scripts/hosts.py


def test_default_hosts_names_addresses_labels() -> None:
    specs = testbed.host_specs()
    assert [(h["name"], h["netns"], h["veth"], h["ip"], h["head"]) for h in specs] == [
        ("head", "pds-head", "pdsv0", "198.18.0.10", True),
        ("prefill", "pds-prefill", "pdsv1", "198.18.0.11", False),
        ("decode", "pds-decode", "pdsv2", "198.18.0.12", False),
    ]
    assert specs[1]["labels"] == {"pdserve.io/host": "prefill", "pdserve.io/pool": "prefill"}
    assert specs[0]["labels"] == {"pdserve.io/host": "head"}
    assert all(h["num_cpus"] == 2 and h["num_gpus"] == 0 for h in specs)
    assert specs[2]["resources"] == {"host:decode": 1000}


@pytest.mark.parametrize(
    ("name", "pool"),
    [("prefill2", "prefill"), ("decode-b", "decode"), ("decode_1", "decode"), ("prefillx", None), ("head", None)],
)
def test_pool_label_from_the_host_name(name: str, pool: str | None) -> None:
    assert testbed.default_labels(name).get("pdserve.io/pool") == pool


def test_labels_resources_cpus_gpus_merge_over_the_defaults() -> None:
    specs = testbed.host_specs(
        ["head", "prefill"],
        cpus={"prefill": 4},
        gpus={"prefill": 8},
        labels={"prefill": {"pdserve.io/pool": "", "zone": "a"}},
        resources={"head": {"x": 2.0}},
    )
    assert [h["num_cpus"] for h in specs] == [2, 4] and [h["num_gpus"] for h in specs] == [0, 8]
    assert specs[1]["labels"] == {"pdserve.io/host": "prefill", "zone": "a"}
    assert specs[0]["resources"] == {"host:head": 1000, "x": 2.0}


@pytest.mark.parametrize(
    ("hosts", "kwargs", "message"),
    [
        ([], {}, "no hosts"),
        (["a", "a"], {}, "duplicate"),
        (["Head"], {}, "bad host name"),
        (["head"], {"cpus": {"other": 1}}, "cpus for unknown hosts"),
    ],
)
def test_bad_host_specs(hosts: list[str], kwargs: dict, message: str) -> None:
    with pytest.raises(testbed.HostsError, match=message):
        testbed.host_specs(hosts, **kwargs)


def test_exec_argv_without_env() -> None:
    assert testbed.exec_argv("decode", ["true"], env=False) == ["ip", "netns", "exec", "pds-decode", "true"]


def test_up_flags_become_the_library_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def up(hosts, **kwargs):
        calls.append((hosts, kwargs))
        raise testbed.HostsError("not here")

    monkeypatch.setattr(testbed, "up", up)
    argv = ["up", "--hosts", "head,prefill2", "--cpus", "3", "--cpus", "prefill2=4", "--label", "head=k=v"]
    argv += ["--labels", "prefill2=pdserve.io/pool=", "--resource", "head=r=2.5", "--gpus", "prefill2=8"]
    argv += ["--object-store-mb", "300", "--auth", "disabled", "--ray-env", "RAY_x=1", "--timeout", "30", "--fresh"]
    assert cli.main(argv) == 1
    assert cli.main(["up"]) == 1
    assert calls == [
        (
            ["head", "prefill2"],
            {
                "cpus": {"head": 3, "prefill2": 4},
                "gpus": {"prefill2": 8},
                "labels": {"head": {"k": "v"}, "prefill2": {"pdserve.io/pool": ""}},
                "resources": {"head": {"r": 2.5}},
                "object_store_mb": 300,
                "auth": "disabled",
                "ray_env": {"RAY_x": "1"},
                "timeout_s": 30.0,
                "fresh": True,
            },
        ),
        (
            ["head", "prefill", "decode"],
            {
                "cpus": 2,
                "gpus": {},
                "labels": {},
                "resources": {},
                "object_store_mb": 200,
                "auth": "token",
                "ray_env": {},
                "timeout_s": 120.0,
                "fresh": False,
            },
        ),
    ]


def test_a_bad_flag_is_an_error_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["up", "--labels", "head=nokey"]) == 1
    assert capsys.readouterr().err == "hosts.py: bad --labels 'head=nokey'\n"


def test_the_script_runs_from_anywhere_and_says_when_no_bed_is_up(tmp_path: Path) -> None:
    env = dict(os.environ, PDS_HOSTS_DIR=str(tmp_path))
    for sub in ([], ["up"], ["down"], ["status"], ["exec"], ["kill"], ["restart"]):
        result = subprocess.run([sys.executable, str(CLI), *sub, "--help"], capture_output=True, text=True, cwd="/")
        assert result.returncode == 0 and "usage: hosts.py" in result.stdout, result.stderr
    result = subprocess.run([sys.executable, str(CLI), "kill", "prefill"], capture_output=True, text=True, env=env)
    assert result.returncode == 1
    assert result.stderr == f"hosts.py: no bed is up (no {tmp_path}/state.json): run `python {CLI} up` first\n"
