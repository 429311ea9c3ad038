"""The GPU configs placed on a real Ray cluster of logical GPUs (no GPU needed).

Five namespace hosts (testlib/testbed): a head, two prefill and two decode hosts of 8 logical GPUs
each (`ray start --num-gpus 8`). `pdserve validate --ray-address` places configs/gpu-multinode.yaml
and configs/gpu-1node.yaml on them, and Ray itself creates each engine's placement group as the
controller asks for it: every bundle on a host of the engine's pool, all of an engine's TP ranks on
one host (STRICT_PACK). What it cannot show here: vLLM running in those bundles (no GPU build of vLLM).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.test_multihost import PDSERVE, ROOT, hosts, pytestmark  # noqa: F401 - same markers

HOSTS = ("head", "prefill", "prefill2", "decode", "decode2")
GPUS = {name: 8 for name in HOSTS[1:]}
HEAD = "198.18.0.10:6379"

PLACE_ENGINES = r"""
import json, sys
import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from orchestrator.launch import plan_engines
from orchestrator.spec import ClusterSpec

spec = ClusterSpec.from_file(sys.argv[1])
ray.init(address=sys.argv[2], log_to_driver=False)

@ray.remote(num_cpus=0)
def where():
    return ray.util.get_node_ip_address()

nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
placed = {}
for launch in plan_engines(spec, host=None)[: spec.prefill.replicas + spec.decode.replicas]:
    if int(launch.engine_id.rpartition("-")[2]) >= spec.pool(launch.role).replicas:
        continue
    group = ray.util.placement_group(**launch.placement.placement_group_args())
    ray.get(group.ready(), timeout=60)
    table = ray.util.placement_group_table(group)
    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
    placed[launch.engine_id] = {
        "bundles": sorted(nodes[n] for n in table["bundles_to_node_id"].values()),
        "actor_on": ray.get(where.options(scheduling_strategy=strategy).remote()),
    }
print(json.dumps(placed))
"""


@pytest.fixture(scope="module")
def gpu_bed():
    hosts.up(HOSTS, gpus=GPUS, fresh=True)
    try:
        yield
    finally:
        hosts.down()
    assert not hosts.namespaces()


def run_in_head(argv: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(hosts.exec_argv("head", argv), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_gpu_configs_validate_on_logical_gpus(gpu_bed, tmp_path):
    multinode = run_in_head([*PDSERVE, "validate", "configs/gpu-multinode.yaml", "--ray-address", HEAD])
    assert multinode.returncode == 0, multinode.stdout + multinode.stderr
    for ip in ("198.18.0.11", "198.18.0.12", "198.18.0.13", "198.18.0.14"):
        assert f"  host {ip}:" in multinode.stdout
    one_node = run_in_head([*PDSERVE, "validate", "configs/gpu-1node.yaml", "--ray-address", HEAD])
    assert one_node.returncode == 0, one_node.stdout + one_node.stderr
    too_wide = yaml.safe_load((ROOT / "configs" / "gpu-multinode.yaml").read_text())
    too_wide["decode"] |= {"replicas": 1, "tensor_parallel_size": 16}  # more GPUs than one decode host has
    path = tmp_path / "too-wide.yaml"
    path.write_text(yaml.safe_dump(too_wide))
    result = run_in_head([*PDSERVE, "validate", str(path), "--ray-address", HEAD])
    assert result.returncode == 1
    assert "cannot place: decode: decode-0 needs GPU 16 (STRICT_PACK)" in result.stdout


def test_each_engine_gets_a_placement_group_on_its_pools_hosts(gpu_bed):
    spec_path = str(Path("configs") / "gpu-multinode.yaml")
    result = run_in_head([sys.executable, "-c", PLACE_ENGINES, spec_path, HEAD])
    assert result.returncode == 0, result.stderr[-3000:]
    placed = json.loads(result.stdout.strip().splitlines()[-1])
    spec = yaml.safe_load((ROOT / "configs" / "gpu-multinode.yaml").read_text())
    pool_hosts = {"prefill": {"198.18.0.11", "198.18.0.12"}, "decode": {"198.18.0.13", "198.18.0.14"}}
    assert len(placed) == spec["prefill"]["replicas"] + spec["decode"]["replicas"]
    for engine_id, where in placed.items():
        role = engine_id.rpartition("-")[0]
        assert len(where["bundles"]) == spec[role]["tensor_parallel_size"]
        assert len(set(where["bundles"])) == 1, f"{engine_id}: TP ranks on several hosts {where}"
        assert where["bundles"][0] in pool_hosts[role], f"{engine_id} placed off its pool's hosts: {where}"
        assert where["actor_on"] == where["bundles"][0]
