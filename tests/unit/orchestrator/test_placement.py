"""Placement across hosts: what engines ask Ray for, per-host core plans, fitting a plan onto nodes,
the plan per host, and the address an engine advertises."""

from __future__ import annotations

import json

import pytest

from orchestrator.address import AddressError, advertised_address, interface_address
from orchestrator.errors import SpecError
from orchestrator.launch import plan_engines
from orchestrator.placement import HEAD_RESOURCE, Node, assign, control_placement, engine_placement, host_plan
from orchestrator.spec import ClusterSpec

PREFILL_HOST = {"pdserve.io/pool": "prefill"}
DECODE_HOST = {"pdserve.io/pool": "decode"}


def split_spec(make_spec, **overrides):
    """Prefill and decode pools on hosts of their own, as configs/multi-host-cpu.yaml has them."""
    spec = make_spec(
        prefill={"placement": {"node_labels": PREFILL_HOST}},
        decode={"placement": {"node_labels": DECODE_HOST}},
    )
    for key, value in overrides.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return ClusterSpec.from_dict(spec)


def node(ip: str, labels: dict[str, str] | None = None, cpus: float = 2, gpus: float = 0, head: bool = False, **extra):
    resources = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **extra}
    if head:
        resources[HEAD_RESOURCE] = 1.0
    return Node(node_id=ip, ip=ip, labels=labels or {}, resources=resources)


THREE_HOSTS = [node("198.18.0.10", head=True), node("198.18.0.11", PREFILL_HOST), node("198.18.0.12", DECODE_HOST)]


# --- what engines ask Ray for -------------------------------------------------------------------


def test_cpu_engines_ask_for_their_pools_labels_and_resources_per_tp_rank(make_spec):
    spec = ClusterSpec.from_dict(
        make_spec(
            prefill={"tensor_parallel_size": 2, "placement": {"node_labels": PREFILL_HOST, "resources": {"fast": 1}}}
        )
    )
    options = engine_placement(spec, "prefill").actor_options()
    assert options == {"num_cpus": 2.0, "num_gpus": 0.0, "label_selector": PREFILL_HOST, "resources": {"fast": 2.0}}
    assert engine_placement(spec, "decode").actor_options() == {"num_cpus": 1.0, "num_gpus": 0.0}


def test_gpu_engines_spread_bundles_when_the_spec_says(make_spec):
    spec = ClusterSpec.from_dict(
        make_spec(
            device="cuda",
            resources={"gpus": 8},
            decode={"tensor_parallel_size": 4, "placement": {"node_labels": DECODE_HOST, "strategy": "SPREAD"}},
        )
    )
    args = engine_placement(spec, "decode").placement_group_args()
    assert args["strategy"] == "SPREAD" and len(args["bundles"]) == 4
    assert args["bundle_label_selector"] == [DECODE_HOST] * 4


def test_the_control_plane_runs_on_the_head_node_unless_the_spec_says(make_spec):
    assert control_placement(ClusterSpec.from_dict(make_spec())).actor_options()["resources"] == {HEAD_RESOURCE: 0.001}
    spec = ClusterSpec.from_dict(make_spec(proxy={"placement": {"node_labels": {"role": "gateway"}}}))
    assert control_placement(spec).actor_options() == {
        "num_cpus": 0.0,
        "num_gpus": 0.0,
        "label_selector": {"role": "gateway"},
    }


# --- per-host core plans ------------------------------------------------------------------------


def test_pools_on_different_hosts_each_have_their_own_core_plan(make_spec):
    engines = {e.engine_id: e for e in plan_engines(split_spec(make_spec), host=None)}
    assert engines["prefill-0"].cpu_bind == "0" and engines["decode-0"].cpu_bind == "0"


def test_pools_sharing_hosts_get_disjoint_cores(make_spec):
    engines = {e.engine_id: e for e in plan_engines(ClusterSpec.from_dict(make_spec()), host=None)}
    assert engines["prefill-0"].cpu_bind == "0" and engines["decode-0"].cpu_bind == "1"


def test_first_core_moves_a_pools_plan(make_spec):
    spec = ClusterSpec.from_dict(
        make_spec(
            prefill={"placement": {"node_labels": PREFILL_HOST}},
            decode={"placement": {"node_labels": DECODE_HOST, "first_core": 1}},
        )
    )
    engines = {e.engine_id: e for e in plan_engines(spec, host=None)}
    assert engines["prefill-0"].cpu_bind == "0" and engines["decode-0"].cpu_bind == "1"


def test_a_host_without_the_cores_its_pool_needs_names_the_field(make_spec):
    decode = {"placement": {"node_labels": DECODE_HOST, "first_core": 1}, "cpu_cores": 2}
    with pytest.raises(SpecError, match=r"resources\.cpus.*need 3 CPU cores on one host"):
        ClusterSpec.from_dict(make_spec(resources={"cpus": 2}, decode=decode))
    ClusterSpec.from_dict(make_spec(resources={"cpus": 3}, decode=decode))  # 1 + 2 cores fit


@pytest.mark.parametrize("labels", [{"bad key!": "x"}, {"pdserve.io/pool": "bad value!"}, {"k": "x" * 64}])
def test_a_label_ray_would_refuse_is_refused_here(make_spec, labels):
    with pytest.raises(SpecError, match=r"prefill\.placement\.node_labels"):
        ClusterSpec.from_dict(make_spec(prefill={"placement": {"node_labels": labels}}))


# --- fitting a plan onto the cluster's nodes ---------------------------------------------------


def test_three_hosts_take_the_proxy_prefill_and_decode(make_spec):
    where, problems = assign(split_spec(make_spec), THREE_HOSTS)
    assert problems == []
    assert where == {"proxy+controller": "198.18.0.10", "prefill-0": "198.18.0.11", "decode-0": "198.18.0.12"}


def test_no_node_with_the_pools_labels_names_the_field_and_the_nodes(make_spec):
    _, problems = assign(split_spec(make_spec), THREE_HOSTS[:2])
    assert len(problems) == 1
    assert problems[0].startswith("decode.placement: no alive Ray node is one of nodes with pdserve.io/pool=decode")
    assert "198.18.0.11" in problems[0]


def test_a_dead_node_holds_nothing(make_spec):
    dead = Node("198.18.0.12", "198.18.0.12", DECODE_HOST, {"CPU": 2}, alive=False)
    _, problems = assign(split_spec(make_spec), [*THREE_HOSTS[:2], dead])
    assert [p.split(":")[0] for p in problems] == ["decode.placement"]


def test_too_few_cpus_on_the_pools_hosts_says_what_is_left(make_spec):
    spec = split_spec(
        make_spec, prefill={"replicas": 2, "port": 8100, "kv_port": 5600, "placement": {"node_labels": PREFILL_HOST}}
    )
    hosts = [THREE_HOSTS[0], node("198.18.0.11", PREFILL_HOST, cpus=1), THREE_HOSTS[2]]
    where, problems = assign(spec, hosts)
    assert where["prefill-0"] == "198.18.0.11"
    assert problems == [
        "prefill: prefill-1 needs CPU 1 (on one node) but the nodes it may use (nodes with pdserve.io/pool=prefill) "
        "have left 198.18.0.11: CPU 0"
    ]


def test_gpu_engines_strict_pack_on_one_node(make_spec):
    spec = ClusterSpec.from_dict(
        make_spec(
            device="cuda",
            resources={"gpus": 8},
            prefill={"tensor_parallel_size": 4},
            decode={"tensor_parallel_size": 4},
        )
    )
    one_node = [node("10.0.0.1", cpus=16, gpus=8, head=True)]
    where, problems = assign(spec, one_node)
    assert problems == [] and set(where.values()) == {"10.0.0.1"}
    two_small = [node("10.0.0.1", cpus=16, gpus=2, head=True), node("10.0.0.2", cpus=16, gpus=2)]
    _, problems = assign(spec, two_small)
    assert problems[0].startswith("prefill: prefill-0 needs GPU 4 (STRICT_PACK) but the nodes it may use (any node)")


def test_host_plan_without_a_cluster_groups_engines_by_placement(make_spec):
    spec = split_spec(make_spec)
    lines = host_plan(spec, plan_engines(spec, host=None))
    assert lines == [
        "  on Ray head node:",
        "    proxy, controller",
        "  on pdserve.io/pool=prefill:",
        "    prefill-0  cores 0, port 8100, kv_port 5600",
        "  on pdserve.io/pool=decode:",
        "    decode-0   cores 0, port 8200, kv_port 5700",
    ]


def test_host_plan_on_nodes_lists_each_host_and_what_cannot_be_placed(make_spec):
    spec = split_spec(make_spec)
    lines = host_plan(spec, plan_engines(spec, host=None), assign(spec, THREE_HOSTS[:2]))
    assert lines[:4] == [
        "  host 198.18.0.10:",
        "    proxy, controller",
        "  host 198.18.0.11:",
        "    prefill-0  cores 0, port 8100, kv_port 5600",
    ]
    assert lines[4].startswith("  cannot place: decode.placement: no alive Ray node")


# --- addresses ----------------------------------------------------------------------------------


def test_an_engine_resolved_on_its_node_advertises_that_address_everywhere(make_spec):
    launch = plan_engines(split_spec(make_spec), host=None)[0]
    assert launch.host is None
    placed = launch.on_host("198.18.0.11")
    assert placed.url == "http://198.18.0.11:8100"
    assert placed.kv_endpoints == ("tcp://198.18.0.11:5600",)
    args = placed.vllm_args
    assert args[args.index("--host") + 1] == "198.18.0.11"
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"]["side_channel_host"] == "198.18.0.11"
    assert placed.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "198.18.0.11"


def test_listen_all_binds_everywhere_but_advertises_the_node(make_spec):
    spec = split_spec(make_spec, network={"listen_all": True})
    launch = plan_engines(spec, host=None)[0]
    placed = launch.on_host("198.18.0.11", launch.bind)
    assert placed.vllm_args[placed.vllm_args.index("--host") + 1] == "0.0.0.0"
    assert placed.url == "http://198.18.0.11:8100"


def test_the_advertised_address_is_the_node_ip_or_the_named_interface():
    assert advertised_address(None, "198.18.0.12") == "198.18.0.12"
    assert advertised_address("lo", "198.18.0.12") == interface_address("lo") == "127.0.0.1"
    with pytest.raises(AddressError, match=r"network\.interface: this host has no interface 'nope0' \(it has .*lo"):
        advertised_address("nope0", "198.18.0.12")
    with pytest.raises(AddressError, match="not an address another host can reach"):
        advertised_address(None, "0.0.0.0")


def test_a_gpu_engine_that_does_not_fit_takes_nothing_from_the_nodes(make_spec):
    # prefill-0 (TP 3, STRICT_SPREAD) needs 3 hosts and finds 2: decode-0 (TP 1) still gets a GPU after it.
    spec = ClusterSpec.from_dict(
        make_spec(
            device="cuda",
            resources={"gpus": 4},
            prefill={"tensor_parallel_size": 3, "placement": {"strategy": "STRICT_SPREAD"}},
        )
    )
    where, problems = assign(spec, [node("10.0.0.1", gpus=1, head=True), node("10.0.0.2", gpus=1)])
    assert [p.split(" (")[0] for p in problems] == ["prefill: prefill-0 needs GPU 3"]
    assert where["decode-0"] == "10.0.0.1"
