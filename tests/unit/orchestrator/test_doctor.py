"""``pdserve doctor``'s decisions on faked hosts (``HostProbe``), and its measurement for real on this CPU host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from connectors.transport import Where
from orchestrator.cli import main
from orchestrator.doctor import examine, render
from orchestrator.doctor.diagnose import BROKEN, OK, SLOW, Pools, default_pools, diagnose, places, ucx_allows
from orchestrator.doctor.measure import Geometry, measure
from orchestrator.doctor.probes import Gpu, HostProbe
from orchestrator.spec import ClusterSpec

REPO = Path(__file__).resolve().parents[3]
CPU_HOST = HostProbe(
    node="n1", nixl_build="nixl_cu12", nixl_version="1.5.1", nixl_plugins=("POSIX", "UCX"),
    ucx_modules=("cma", "cuda", "ib"),
)  # fmt: skip
GPU_HOST = HostProbe(
    node="g1", nixl_build="nixl_cu13", nixl_version="1.5.1", nixl_plugins=("UCX",), ucx_modules=("cma", "cuda", "ib"),
    machine_cuda_major=13, gpus=(Gpu(0, "H200", "GPU-a"), Gpu(1, "H200", "GPU-b")),
    peer_access=((True, True), (True, True)), rdma_devices=("mlx5_0",),
)  # fmt: skip


def pools(memory: str = "cpu", tls: str | None = None, connector: str = "pdserve", *where: Where) -> list[Pools]:
    chosen = where or (Where.SAME_NODE, Where.OTHER_NODE)
    return [Pools("m", connector, ("cuda-ipc", "nixl"), memory, tls, tuple((w, "test") for w in chosen))]


def findings(report) -> list[str]:
    return [f"{f.level}: {f.what}" for f in report.findings]


def test_cpu_caches_take_nixl_over_shared_memory_on_one_node_and_tcp_between_nodes_without_rdma():
    same, other = diagnose(pools(), CPU_HOST)
    assert (same.transport, same.ucx, same.verdict) == ("nixl", ("posix", "sysv", "cma", "tcp"), OK)
    assert findings(same) == ["info: cuda-ipc stands aside: the caches are in CPU memory"]
    assert (other.transport, other.ucx, other.verdict) == ("nixl", ("tcp",), SLOW)
    assert "no RDMA device on this host" in findings(other)[-1]
    with_rdma = HostProbe(**{**CPU_HOST.__dict__, "rdma_devices": ("mlx5_0",)})
    assert diagnose(pools(), with_rdma)[1].ucx == ("rc", "dc", "ud", "tcp")


def test_ucx_tls_that_leaves_only_tcp_where_shared_memory_exists_is_named_with_its_fix():
    same, _ = diagnose(pools("cpu", "tcp"), CPU_HOST)
    assert same.ucx == ("tcp",) and same.verdict == SLOW
    finding = same.findings[-1]
    assert "UCX_TLS=tcp leaves UCX only TCP here, where it could use posix, sysv, cma" in finding.what
    assert "leave UCX_TLS out of engine.env" in finding.fix
    assert ucx_allows("^tcp", "posix") and not ucx_allows("^tcp", "tcp") and ucx_allows("sm,cuda", "cuda_ipc")
    assert not ucx_allows("rc,tcp", "posix") and ucx_allows("all", "rc") and ucx_allows(None, "tcp")


def test_gpu_engines_of_one_node_read_each_other_over_cuda_ipc_where_their_gpus_have_peer_access():
    """vLLM 0.32's Ray workers see every GPU of their node: engines on two GPUs with peer access take cuda-ipc;
    GPUs without it leave NIXL (over UCX's cuda_ipc where UCX takes it), and the doctor names the pair."""
    same, other = diagnose(pools("cuda"), GPU_HOST)
    assert same.transports == ("cuda-ipc", "nixl") and same.verdict == OK and same.ucx == ()
    assert other.transports == ("nixl",) and other.ucx == ("rc", "dc", "tcp") and other.verdict == OK

    no_p2p = HostProbe(**{**GPU_HOST.__dict__, "peer_access": ((True, False), (False, True))})
    same, _ = diagnose(pools("cuda"), no_p2p)
    assert same.transport == "nixl" and same.ucx == ("cuda_ipc", "cuda_copy", "tcp")
    assert same.verdict == SLOW and "without peer access (0->1, 1->0)" in findings(same)[0]

    (cpu_probe,) = diagnose(pools("cuda", None, "pdserve", Where.SAME_NODE), CPU_HOST)  # a GPU spec checked on a CPU
    assert cpu_probe.transport == "cuda-ipc" and "peer access is not checked" in findings(cpu_probe)[0]


def test_vllms_ray_workers_see_every_gpu_of_their_node_and_pdserve_does_not_hide_any():
    """What cuda-ipc between GPUs of a node stands on: vLLM 0.32 has Ray leave CUDA_VISIBLE_DEVICES unset in its
    GPU workers (and picks each worker's GPU by rank); pdserve's GPU engines run those workers (its Ray executor)
    and set no CUDA_VISIBLE_DEVICES of their own."""
    import inspect

    import vllm
    from vllm.v1.executor.ray_executor import RayDistributedExecutor

    from orchestrator.launch import plan_engines

    # vLLM's CUDA platform does not import on a CPU build: its source says what it sets
    cuda_platform = (Path(vllm.__file__).parent / "platforms" / "cuda.py").read_text()
    assert '"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"' in cuda_platform.split("ray_noset_device_env_vars")[1][:200]
    assert "self._update_noset_device_env_vars(" in inspect.getsource(RayDistributedExecutor._init_workers_ray)
    spec = ClusterSpec.from_file(REPO / "configs" / "gpu-1node.yaml")
    for launch in plan_engines(spec):
        at = launch.vllm_args.index("--distributed-executor-backend")
        assert launch.vllm_args[at + 1] == "ray"
        assert "CUDA_VISIBLE_DEVICES" not in launch.env


def test_a_nixl_wheel_of_another_cuda_sends_vram_over_tcp_and_says_which_to_install():
    wrong = HostProbe(**{**GPU_HOST.__dict__, "nixl_build": "nixl_cu12"})
    same, _ = diagnose(pools("cuda", None, "vllm-nixl"), wrong)
    assert same.ucx == ("tcp",) and same.verdict == SLOW
    assert any("NIXL loads nixl_cu12, built for another CUDA than this machine's 13" in f for f in findings(same))
    assert any("pip install nixl-cu13==1.5.1" in (f.fix or "") for f in same.findings)


def test_no_nixl_or_no_ucx_backend_is_broken():
    gone = HostProbe(problems=("NIXL is not importable: ModuleNotFoundError: No module named 'nixl'",))
    assert diagnose(pools(), gone)[0].verdict == BROKEN
    assert "No module named 'nixl'" in findings(diagnose(pools(), gone)[0])[-1]
    no_ucx = HostProbe(**{**CPU_HOST.__dict__, "nixl_plugins": ("POSIX",)})
    assert diagnose(pools(), no_ucx)[0].verdict == BROKEN


def test_places_follow_the_spec():
    spec = ClusterSpec.from_file(REPO / "configs" / "local-cpu.yaml")
    assert [w for w, _ in places(spec)] == [Where.SAME_NODE]
    assert [w for w, _ in places(ClusterSpec.from_file(REPO / "configs" / "multi-host-cpu.yaml"))] == [Where.OTHER_NODE]
    assert [w for w, _ in default_pools(CPU_HOST)[0].places] == [Where.SAME_NODE, Where.OTHER_NODE]


def test_doctor_measures_shared_memory_and_tcp_on_this_host(tmp_path, capsys):
    """For real: two processes, the connector's NIXL transport, scattered blocks checked byte for byte."""
    geometry = Geometry(layers=4, heads=2, head_dim=64, block_size=128, dtype="bfloat16")
    shm = measure(geometry, {}, size_mib=8)
    tcp = measure(geometry, {"UCX_TLS": "tcp"}, size_mib=8)
    assert shm.checked and tcp.checked and shm.blocks == 8 * 2**20 // geometry.block_bytes
    assert shm.gbps > 0 and tcp.gbps > 0 and 0 < shm.share_of_copy
    print(f"doctor on this host: shared memory {shm.gbps:.2f} GB/s, TCP {tcp.gbps:.2f} GB/s")


def test_pdserve_doctor_prints_each_path_and_json(tmp_path, capsys, monkeypatch):
    spec = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())
    spec["engine"] = {**spec.get("engine", {}), "env": {"UCX_TLS": "tcp"}}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["doctor", str(path), "--no-measure"]) == 0
    out = capsys.readouterr().out
    assert "prefill -> decode, same-node, cpu memory: slow" in out and "fix: leave UCX_TLS out" in out
    assert main(["doctor", str(path), "--no-measure", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["paths"][0]["transport"] == "nixl" and report["paths"][0]["ucx"] == ["tcp"]
    assert report["geometry"]["layers"] > 0 and report["hosts"]["this host"]["nixl_build"]
    lines = render(examine(None, measured=False, probe=CPU_HOST), None)
    assert lines[0] == "pdserve doctor: no spec (pdserve defaults)"


def test_pdserve_doctor_json_on_stdout_is_the_json_alone_and_nixls_log_goes_to_stderr(tmp_path):
    """``pdserve doctor --json > out.json`` gives a file that parses: NIXL logs on standard output (its INFO
    line when the probe starts an agent), which the command sends to standard error."""
    env = os.environ | {"NIXL_LOG_LEVEL": "INFO", "PDSERVE_STATE_DIR": str(tmp_path / "state")}
    command = [sys.executable, "-m", "orchestrator.cli", "doctor", str(REPO / "configs" / "local-cpu.yaml")]
    done = subprocess.run(
        [*command, "--no-measure", "--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )

    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["paths"][0]["transport"] == "nixl"
    if report["hosts"]["this host"]["nixl_build"]:
        assert "NIXL" in done.stderr  # its log went somewhere: to stderr


@pytest.fixture(autouse=True)
def _quiet_nixl(monkeypatch):
    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")


def test_beside_a_cluster_each_decode_node_gets_the_places_its_engines_are_in():
    from orchestrator.doctor.remote import Node, engine_places

    nodes = [Node(None, "n1", "198.18.0.1", CPU_HOST), Node(None, "n2", "198.18.0.2", CPU_HOST)]
    engines = [
        {"role": "prefill", "host": "198.18.0.1", "model": "m", "state": "ready"},
        {"role": "decode", "host": "198.18.0.1", "model": "m", "state": "ready"},
        {"role": "decode", "host": "198.18.0.2", "model": "m", "state": "ready"},
        {"role": "decode", "host": "198.18.0.2", "model": "other", "state": "ready"},
    ]
    assert engine_places(engines, nodes, "m") == {"n1": {Where.SAME_NODE}, "n2": {Where.OTHER_NODE}}
    one = [Node(None, "n1", "10.0.0.5", CPU_HOST)]  # engines at 127.0.0.1 on a one-node cluster
    local = [dict(e, host="127.0.0.1") for e in engines[:2]]
    assert engine_places(local, one, "m") == {"n1": {Where.SAME_NODE}}


def test_a_ucx_cuda_module_that_does_not_load_sends_vram_over_tcp_and_names_the_missing_library():
    from dataclasses import replace

    host = replace(GPU_HOST, ucx_module_errors={"cuda": "libnvidia-ml.so.1: cannot open shared object file"})
    (same,) = diagnose(pools("cuda", None, "vllm-nixl", Where.SAME_NODE), host)
    assert same.ucx == ("tcp",)
    assert any("libnvidia-ml.so.1" in f.what and "LD_LIBRARY_PATH" in (f.fix or "") for f in same.findings)
    lines = render(examine(None, measured=False, probe=host), None)
    assert "  UCX module cuda does not load: libnvidia-ml.so.1: cannot open shared object file" in lines


def test_the_probe_names_a_shared_library_that_does_not_load(tmp_path):
    from orchestrator.doctor.probes import loads

    broken = tmp_path / "libuct_broken.so"
    broken.write_bytes(b"not an ELF file")
    assert "libuct_broken.so" in loads(broken)
    assert loads(Path("/lib/x86_64-linux-gnu/libc.so.6")) is None


def test_gpu_paths_are_measured_in_vram_and_nixl_no_faster_than_tcp_points_at_cuda_ipc(monkeypatch):
    """The doctor measures a GPU path with caches on the GPU: CUDA IPC where it is the transport, NIXL (and TCP
    beside it) where not; a NIXL no faster than TCP over VRAM names cuda-ipc as the way out."""
    import orchestrator.doctor as doctor
    from orchestrator.doctor.measure import Measurement

    asked = []

    def fake(geometry, env, memory, transport):
        asked.append((env.get("UCX_TLS"), memory, transport))
        gbps = {"cuda-ipc": 900.0}.get(transport, 0.4)
        return Measurement(64.0, 32, 1024, gbps, 1400.0, gbps / 1400.0, True)

    monkeypatch.setattr(doctor, "attempt", fake)
    one_gpu = HostProbe(
        node="g1", nixl_build="nixl_cu13", nixl_version="1.5.1", nixl_plugins=("UCX",), ucx_modules=("cuda",),
        machine_cuda_major=13, gpus=(Gpu(0, "H200", "GPU-a"),), peer_access=((True,),),
    )  # fmt: skip
    same, other = examine(None, measured=True, probe=one_gpu).reports
    assert (same.memory, same.transport, same.verdict) == ("cuda", "cuda-ipc", OK)
    assert same.measurement.gbps == 900.0 and asked[0] == (None, "cuda", "cuda-ipc")
    assert other.measurement is not None and ("tcp,cuda_copy", "cuda", "nixl") in asked

    asked.clear()
    no_p2p = HostProbe(**{**GPU_HOST.__dict__, "peer_access": ((True, False), (False, True))})
    same, _ = examine(None, measured=True, probe=no_p2p).reports
    assert same.transport == "nixl" and (None, "cuda", "nixl") in asked and ("tcp,cuda_copy", "cuda", "nixl") in asked
    assert any("no faster than TCP" in f.what and "cuda-ipc" in (f.fix or "") for f in same.findings)
