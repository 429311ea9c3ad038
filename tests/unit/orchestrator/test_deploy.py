"""The shipped GPU specs (configs/gpu-1node.yaml, configs/gpu-multinode.yaml) and the KubeRay manifests
(deploy/kuberay/): the specs' placement plans on made-up Ray nodes (no Ray, no GPU), and that the manifests
describe the Ray cluster the multi-node spec needs."""

from __future__ import annotations

import json
import shlex
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import yaml

from contract.wire import ROLES
from orchestrator import placement
from orchestrator.cli import build_parser
from orchestrator.launch import plan_engines
from orchestrator.models import KNOWN_MODELS
from orchestrator.placement import HEAD_RESOURCE, Node, assign, engine_placement, host_plan
from orchestrator.spec import ClusterSpec

REPO_ROOT = Path(__file__).resolve().parents[3]
GPU_1NODE = REPO_ROOT / "configs" / "gpu-1node.yaml"
GPU_MULTINODE = REPO_ROOT / "configs" / "gpu-multinode.yaml"
KUBERAY = REPO_ROOT / "deploy" / "kuberay"
PREFILL_HOST = {"pdserve.io/pool": "prefill"}
DECODE_HOST = {"pdserve.io/pool": "decode"}
GPU_BUNDLE = {"GPU": 1.0}


def node(ip: str, labels: dict[str, str] | None = None, cpus: float = 32, gpus: float = 0, head: bool = False) -> Node:
    resources = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    if head:
        resources[HEAD_RESOURCE] = 1.0
    return Node(node_id=ip, ip=ip, labels=labels or {}, resources=resources)


HEAD = node("10.0.0.1", cpus=8, head=True)
PREFILL_NODES = [node("10.0.1.1", PREFILL_HOST, gpus=8), node("10.0.1.2", PREFILL_HOST, gpus=8)]
DECODE_NODES = [node("10.0.2.1", DECODE_HOST, gpus=8), node("10.0.2.2", DECODE_HOST, gpus=8)]
MULTINODE_HOSTS = [HEAD, *PREFILL_NODES, *DECODE_NODES]


@pytest.fixture(scope="module")
def one_node() -> ClusterSpec:
    return ClusterSpec.from_file(GPU_1NODE)


@pytest.fixture(scope="module")
def multinode() -> ClusterSpec:
    return ClusterSpec.from_file(GPU_MULTINODE)


def gpus_of_pool(spec: ClusterSpec, role: str) -> int:
    return spec.pool(role).replicas * spec.pool(role).tensor_parallel_size


def gpus_of(spec: ClusterSpec) -> int:
    return sum(gpus_of_pool(spec, role) for role in ROLES)


# --- the specs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [GPU_1NODE, GPU_MULTINODE], ids=lambda p: p.stem)
def test_gpu_specs_load_with_a_hub_model_and_tp_pools(path):
    spec = ClusterSpec.from_file(path)
    assert spec.device == "cuda" and spec.connector == "pdserve"
    assert "/" in spec.model and spec.model not in KNOWN_MODELS  # a Hugging Face id, passed through to vLLM
    assert spec.autoscaling is None
    for role in ROLES:
        assert spec.pool(role).tensor_parallel_size > 1
        assert spec.pool(role).placement.strategy == "STRICT_PACK"
    assert gpus_of(spec) == spec.resources.gpus


def test_one_node_spec_splits_the_eight_gpus_between_the_pools(one_node):
    assert one_node.resources.gpus == 8
    assert one_node.ray.address is None  # pdserve starts a local Ray head with --num-gpus=8
    assert placement.placement_domains(one_node) == {((), ()): ("prefill", "decode")}  # both pools on the same node
    assert {role: gpus_of_pool(one_node, role) for role in ROLES} == {"prefill": 4, "decode": 4}


def test_multinode_spec_joins_a_ray_cluster_with_labelled_pools(multinode):
    assert multinode.ray.address == "auto"
    assert multinode.proxy.host == "0.0.0.0" and multinode.proxy.placement is None  # on the Ray head node
    assert multinode.prefill.placement.node_labels == PREFILL_HOST
    assert multinode.decode.placement.node_labels == DECODE_HOST
    assert multinode.resources.gpus == 32


# --- what each engine asks Ray for ---------------------------------------------------------------


@pytest.mark.parametrize("path", [GPU_1NODE, GPU_MULTINODE], ids=lambda p: p.stem)
def test_each_gpu_engine_is_one_strict_pack_placement_group_of_a_bundle_per_tp_rank(path):
    spec = ClusterSpec.from_file(path)
    launches = plan_engines(spec, host=None)
    assert [launch.engine_id for launch in launches] == [
        f"{role}-{i}" for role in ROLES for i in range(spec.pool(role).replicas)
    ]
    for launch in launches:
        pool = spec.pool(launch.role)
        tp, labels = pool.tensor_parallel_size, dict(pool.placement.node_labels)
        assert launch.host is None  # each engine resolves its address on the node it lands on
        assert launch.tp_size == tp and launch.num_gpus == tp and launch.cpu_bind is None
        assert launch.placement == engine_placement(spec, launch.role)
        args = launch.placement.placement_group_args()
        assert args["bundles"] == [GPU_BUNDLE] * tp
        assert args["strategy"] == "STRICT_PACK"
        if labels:
            assert args["bundle_label_selector"] == [labels] * tp
        else:
            assert "bundle_label_selector" not in args
        assert launch.placement.demand() == {"GPU": tp}
        flags = launch.vllm_args
        assert flags[flags.index("--tensor-parallel-size") + 1] == str(tp)
        assert flags[flags.index("--distributed-executor-backend") + 1] == "ray"
        assert flags[flags.index("--model") + 1] == spec.model
        assert launch.env["HF_HUB_OFFLINE"] == "0"  # a hub id: vLLM may download it


# --- fitting the plans onto nodes --------------------------------------------------------------


def test_one_node_takes_everything_and_all_its_gpus(one_node):
    gpu_node = node("10.0.0.1", cpus=64, gpus=8, head=True)
    where, problems = assign(one_node, [gpu_node])
    assert problems == []
    assert where == {name: "10.0.0.1" for name in ("proxy+controller", "prefill-0", "prefill-1", "decode-0")}
    used = sum(launch.placement.demand()["GPU"] for launch in plan_engines(one_node, host=None))
    assert used == gpu_node.resources["GPU"] == 8


def test_multinode_puts_each_pool_on_its_labelled_nodes(multinode):
    where, problems = assign(multinode, MULTINODE_HOSTS)
    assert problems == []
    assert where == {
        "proxy+controller": "10.0.0.1",
        "prefill-0": "10.0.1.1",  # first fit, STRICT_PACK: two TP-4 engines per 8-GPU node
        "prefill-1": "10.0.1.1",
        "prefill-2": "10.0.1.2",
        "prefill-3": "10.0.1.2",
        "decode-0": "10.0.2.1",  # one TP-8 engine per node
        "decode-1": "10.0.2.2",
    }


def test_one_node_with_too_few_gpus_names_the_pool_and_what_is_left(one_node):
    where, problems = assign(one_node, [node("10.0.0.1", cpus=64, gpus=4, head=True)])
    assert set(where) == {"proxy+controller", "prefill-0", "prefill-1"}
    assert len(problems) == 1
    assert problems[0].startswith("decode: decode-0 needs GPU 4 (STRICT_PACK) but the nodes it may use (any node)")
    assert problems[0].endswith("have left 10.0.0.1: GPU 0")


def test_a_missing_decode_node_names_the_field_and_what_is_left(multinode):
    where, problems = assign(multinode, [HEAD, *PREFILL_NODES, DECODE_NODES[0]])
    assert where["decode-0"] == "10.0.2.1" and "decode-1" not in where
    assert problems == [
        "decode: decode-1 needs GPU 8 (STRICT_PACK) but the nodes it may use (nodes with "
        "pdserve.io/pool=decode) have left 10.0.2.1: GPU 0"
    ]


def test_enough_gpus_split_across_nodes_do_not_hold_a_strict_pack_engine(multinode):
    small = [node(f"10.0.2.{i}", DECODE_HOST, gpus=4) for i in range(1, 5)]  # 16 GPUs, but 4 per node
    _, problems = assign(multinode, [HEAD, *PREFILL_NODES, *small])
    assert [p.split(" (")[0] for p in problems] == [
        "decode: decode-0 needs GPU 8",
        "decode: decode-1 needs GPU 8",
    ]
    assert all("(STRICT_PACK)" in p for p in problems)


def test_unlabelled_nodes_name_the_pools_placement(multinode):
    unlabelled = [node("10.0.1.1", gpus=8), node("10.0.1.2", gpus=8)]
    where, problems = assign(multinode, [HEAD, *unlabelled, *DECODE_NODES])
    assert not any(name.startswith("prefill") for name in where)
    assert len(problems) == 4  # one per prefill engine
    assert all(
        p.startswith("prefill.placement: no alive Ray node is one of nodes with pdserve.io/pool=prefill (nodes: ")
        for p in problems
    )
    assert "10.0.1.1 {}" in problems[0] and "10.0.2.1 {'pdserve.io/pool': 'decode'}" in problems[0]


def test_no_head_node_names_the_proxy_placement(multinode):
    _, problems = assign(multinode, [*PREFILL_NODES, *DECODE_NODES])
    assert [p.split(":")[0] for p in problems] == ["proxy.placement"]
    assert "no alive Ray node is one of the Ray head node" in problems[0]


def test_dead_nodes_hold_no_engines(multinode):
    dead = [Node(n.node_id, n.ip, n.labels, n.resources, alive=False) for n in DECODE_NODES]
    _, problems = assign(multinode, [HEAD, *PREFILL_NODES, *dead])
    assert [p.split(":")[0] for p in problems] == ["decode.placement", "decode.placement"]


# --- the plan per host (`pdserve validate`) -----------------------------------------------------


@pytest.mark.parametrize("path", [GPU_1NODE, GPU_MULTINODE], ids=lambda p: p.stem)
def test_host_plan_without_nodes_lists_every_engine_once(path):
    spec = ClusterSpec.from_file(path)
    launches = plan_engines(spec, host=None)
    lines = host_plan(spec, launches)
    for launch in launches:
        [line] = [line for line in lines if line.split()[0] == launch.engine_id]
        tp = spec.pool(launch.role).tensor_parallel_size
        assert f"{tp} GPU(s) in one placement group, port {launch.port}, kv_port {launch.kv_port}" in line
    assert lines[:2] == ["  on Ray head node:", "    proxy, controller"]


def test_host_plan_without_nodes_groups_the_multinode_pools_by_label(multinode):
    lines = host_plan(multinode, plan_engines(multinode, host=None))
    assert [line for line in lines if line.startswith("  on ")] == [
        "  on Ray head node:",
        "  on pdserve.io/pool=prefill:",
        "  on pdserve.io/pool=decode:",
    ]
    assert lines[lines.index("  on pdserve.io/pool=decode:") + 1 :] == [
        "    decode-0   8 GPU(s) in one placement group, port 8200, kv_port 5700",
        "    decode-1   8 GPU(s) in one placement group, port 8201, kv_port 5708",
    ]


def test_host_plan_on_nodes_lists_each_host(multinode):
    lines = host_plan(multinode, plan_engines(multinode, host=None), assign(multinode, MULTINODE_HOSTS))
    assert [line for line in lines if line.startswith("  host ")] == [
        f"  host {ip}:" for ip in ("10.0.0.1", "10.0.1.1", "10.0.1.2", "10.0.2.1", "10.0.2.2")
    ]
    assert not any("cannot place" in line for line in lines)


# --- the KubeRay manifests ----------------------------------------------------------------------


def load_all(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((KUBERAY / name).read_text()) if doc is not None]


def load_one(name: str) -> dict[str, Any]:
    [doc] = load_all(name)
    return doc


@pytest.fixture(scope="module")
def raycluster() -> dict[str, Any]:
    return load_one("raycluster.yaml")


@pytest.fixture(scope="module")
def configmap() -> dict[str, Any]:
    return load_one("configmap.yaml")


def worker_groups(raycluster: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {group["groupName"]: group for group in raycluster["spec"]["workerGroupSpecs"]}


def container(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]["containers"][0]


def gpus_per_pod(group: dict[str, Any]) -> int:
    """The pod's GPUs: limits = requests = Ray's num-gpus."""
    resources = container(group)["resources"]
    gpus = int(resources["limits"]["nvidia.com/gpu"])
    assert int(resources["requests"]["nvidia.com/gpu"]) == gpus
    assert int(group["rayStartParams"]["num-gpus"]) == gpus
    return gpus


def nodes_of(raycluster: dict[str, Any]) -> list[Node]:
    """The Ray nodes the RayCluster starts: the head, then each worker pod with its group's labels."""
    head = raycluster["spec"]["headGroupSpec"]
    nodes = [node("head", cpus=float(container(head)["resources"]["limits"]["cpu"]), head=True)]
    for name, group in worker_groups(raycluster).items():
        cpus = float(container(group)["resources"]["limits"]["cpu"])
        for i in range(group["replicas"]):
            nodes.append(node(f"{name}-worker-{i}", group.get("labels"), cpus=cpus, gpus=gpus_per_pod(group)))
    return nodes


@pytest.mark.parametrize(
    ("name", "kinds"),
    [
        ("raycluster.yaml", [("ray.io/v1", "RayCluster")]),
        ("rayjob.yaml", [("ray.io/v1", "RayJob")]),
        ("configmap.yaml", [("v1", "ConfigMap")]),
        ("service.yaml", [("v1", "Service")]),
        ("kustomization.yaml", [("kustomize.config.k8s.io/v1beta1", "Kustomization")]),
    ],
)
def test_every_manifest_parses_with_its_kind(name, kinds):
    assert [(doc["apiVersion"], doc["kind"]) for doc in load_all(name)] == kinds


def test_the_kustomization_applies_every_manifest():
    manifests = {path.name for path in KUBERAY.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(load_one("kustomization.yaml")["resources"]) == manifests


def test_the_configmap_holds_the_multinode_spec_byte_for_byte(configmap, tmp_path):
    [(key, text)] = configmap["data"].items()
    assert text == GPU_MULTINODE.read_text()
    (tmp_path / key).write_text(text)
    assert ClusterSpec.from_file(tmp_path / key) == ClusterSpec.from_file(GPU_MULTINODE)


def test_the_worker_groups_carry_the_pools_node_labels(raycluster, multinode):
    groups = worker_groups(raycluster)
    assert set(groups) == set(ROLES)
    for role in ROLES:
        assert groups[role]["labels"] == multinode.pool(role).placement.node_labels
    assert "labels" not in raycluster["spec"]["headGroupSpec"]


def test_no_group_sets_labels_in_ray_start_params(raycluster):
    """KubeRay >= 1.5 refuses rayStartParams['labels'] (utils.validateRayGroupLabels); the `labels` field sets them."""
    groups = [raycluster["spec"]["headGroupSpec"], *worker_groups(raycluster).values()]
    assert all("labels" not in group["rayStartParams"] for group in groups)


def test_each_pools_pods_hold_its_engines(raycluster, multinode):
    for role, group in worker_groups(raycluster).items():
        pool, gpus = multinode.pool(role), gpus_per_pod(group)
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"]
        assert pool.tensor_parallel_size <= gpus  # STRICT_PACK: an engine's ranks on one pod
        engines_per_pod = gpus // pool.tensor_parallel_size
        assert engines_per_pod * group["replicas"] >= multinode.max_replicas(role)
        assert gpus * group["replicas"] >= pool.replicas * pool.tensor_parallel_size
        assert float(container(group)["resources"]["limits"]["cpu"]) >= gpus  # a core per TP worker process
    total = sum(gpus_per_pod(g) * g["replicas"] for g in worker_groups(raycluster).values())
    assert total == multinode.resources.gpus
    head = raycluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert "nvidia.com/gpu" not in container(head)["resources"]["limits"]


def test_the_spec_fits_the_ray_nodes_the_raycluster_starts(raycluster, multinode):
    where, problems = assign(multinode, nodes_of(raycluster))
    assert problems == []
    assert where["proxy+controller"] == "head"
    for name, host in where.items():
        if name != "proxy+controller":
            assert host.startswith(name.split("-")[0] + "-")  # prefill-* on prefill pods, decode-* on decode pods


def test_the_proxy_port_is_exposed_on_the_head_and_by_the_service(raycluster, multinode):
    port = multinode.proxy.port
    head = raycluster["spec"]["headGroupSpec"]
    assert port in {p["containerPort"] for p in container(head)["ports"]}
    assert {6379, 8265} <= {p["containerPort"] for p in container(head)["ports"]}  # GCS, dashboard (job submission)
    service = load_one("service.yaml")
    # the proxy's port and nothing else: never the dashboard, GCS or client port (they run code on the cluster)
    assert [(p["port"], p.get("targetPort", p["port"])) for p in service["spec"]["ports"]] == [(port, port)]
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert service["spec"]["selector"] == {
        "ray.io/cluster": raycluster["metadata"]["name"],
        "ray.io/node-type": "head",
    }


def test_the_rayjob_runs_pdserve_up_in_the_foreground_on_the_mounted_spec(raycluster, configmap):
    job = load_one("rayjob.yaml")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": raycluster["metadata"]["name"]}
    assert not job["spec"].get("shutdownAfterJobFinishes", False)  # the RayCluster is selected, not owned
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["pdserve", "up"]
    args = build_parser("up").parse_args(argv[1:])
    assert args.detach is False
    config = Path(args.config)
    head = raycluster["spec"]["headGroupSpec"]["template"]["spec"]
    [volume] = [v for v in head["volumes"] if v.get("configMap", {}).get("name") == configmap["metadata"]["name"]]
    [mount] = [m for m in head["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    assert config.parent == Path(mount["mountPath"])
    assert config.name in configmap["data"]


def test_the_raycluster_runs_the_ray_pdserve_pins(raycluster):
    assert raycluster["spec"]["rayVersion"] == version("ray")
    images = {container(raycluster["spec"]["headGroupSpec"])["image"]}
    images |= {container(group)["image"] for group in worker_groups(raycluster).values()}
    assert len(images) == 1  # one image for every pod (the RayJob's submitter takes the head's)


def ray_version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:3])


def test_ray_token_authentication_is_on(raycluster):
    """KubeRay >= 1.5.1 (``authOptions``): a random token in a Secret, RAY_AUTH_MODE/RAY_AUTH_TOKEN on every
    Ray container and on the RayJob's submitter; Ray >= 2.52 (KubeRay refuses token mode below it)."""
    assert raycluster["spec"]["authOptions"] == {"mode": "token"}
    assert ray_version(raycluster["spec"]["rayVersion"]) >= (2, 52, 0)
    # nothing turns it off or pins a token in a manifest (the operator's Secret holds it)
    groups = [raycluster["spec"]["headGroupSpec"], *worker_groups(raycluster).values()]
    env_names = {e["name"] for group in groups for e in container(group).get("env", [])}
    assert not env_names & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"}
    job = load_one("rayjob.yaml")
    assert "RAY_AUTH" not in job["spec"].get("runtimeEnvYAML", "") and "RAY_AUTH" not in job["spec"]["entrypoint"]


def test_no_manifest_exposes_the_dashboard_on_a_service():
    for path in sorted(KUBERAY.glob("*.yaml")):
        for doc in load_all(path.name):
            if doc["kind"] == "Service":
                ports = {p["port"] for p in doc["spec"]["ports"]} | {p.get("targetPort") for p in doc["spec"]["ports"]}
                assert not ports & {8265, "dashboard", 6379, 10001}, path.name


def test_the_monitoring_files_parse_and_name_the_proxy_and_both_pools():
    monitoring = REPO_ROOT / "deploy" / "monitoring"
    dashboard = json.loads((monitoring / "grafana-dashboard.json").read_text())
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ["Proxy", "Engines", "KV plane", "Pools and autoscaler"]
    assert all(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    scrape = yaml.safe_load((monitoring / "prometheus.yml").read_text())
    assert {job["job_name"] for job in scrape["scrape_configs"]} == {"pdserve-proxy", "pdserve-engines"}
    monitor = yaml.safe_load((monitoring / "podmonitor.yaml").read_text())
    roles = {r.get("replacement") for e in monitor["spec"]["podMetricsEndpoints"] for r in e.get("relabelings", [])}
    assert {"prefill", "decode"} <= roles and monitor["spec"]["podMetricsEndpoints"][0]["port"] == "proxy"
