"""Config validation as a user meets it: write a YAML file, load it, read the error.

Every rejection is checked on ``str(SpecError)``, the text ``pdserve validate``
prints: ``<file>: <dotted field>: <reason>``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from orchestrator import placement
from orchestrator.errors import PdserveError, SpecError
from orchestrator.spec import ClusterSpec


@pytest.fixture
def load(write_spec, make_spec) -> Callable[..., ClusterSpec]:
    """Write ``make_spec(**overrides)`` to a file and load it."""

    def load_spec(**overrides: Any) -> ClusterSpec:
        return ClusterSpec.from_file(write_spec(make_spec(**overrides)))

    return load_spec


@pytest.fixture
def rejected(write_spec) -> Callable[[dict[str, Any] | str], tuple[str, SpecError]]:
    """Write ``content`` to a file, expect loading it to fail; return (file path, the SpecError)."""

    def reject(content: dict[str, Any] | str) -> tuple[str, SpecError]:
        path = write_spec(content)
        with pytest.raises(SpecError) as info:
            ClusterSpec.from_file(path)
        return str(path), info.value

    return reject


# --- valid specs ------------------------------------------------------------------------------


def test_shipped_local_cpu_spec_loads_with_one_prefill_and_one_decode(local_cpu_spec: Path):
    spec = ClusterSpec.from_file(local_cpu_spec)

    assert spec.name == "local-cpu"
    assert spec.model_name == "smollm2-135m-instruct"
    assert (spec.device, spec.connector) == ("cpu", "pdserve")
    assert spec.prefill.replicas == 1 and spec.decode.replicas == 1
    assert spec.prefill.ports() == [8100] and spec.decode.ports() == [8200]
    assert spec.proxy.port == 8000


def test_pdserve_connector_can_be_chosen(load):
    spec = load(connector="pdserve")

    assert spec.connector == "pdserve"


def test_defaults_fill_in_everything_optional(load):
    spec = load()

    assert spec.name == "pdserve"
    assert spec.proxy.host == "127.0.0.1" and spec.proxy.port == 8000
    assert spec.prefill.tensor_parallel_size == 1 and spec.prefill.cpu_cores == 1
    assert spec.engine.dtype == "auto" and spec.engine.extra_args == {}
    assert spec.resources.cpus is None and spec.resources.gpus == 0
    assert spec.ray.namespace == "pdserve"


def test_proxy_settings_reach_the_proxy_config(load):
    spec = load(
        proxy={
            "max_body_bytes": 4096,
            "max_concurrent_requests": 8,
            "max_queued_requests": 2,
            "api_key_env": ["PD_KEY", "PD_KEY_2"],
            "admin_key_file": "/etc/pdserve/admin-keys",
        },
        engine={"max_model_len": 2048},
    )

    config = spec.proxy_config()

    assert (config.model_name, config.max_model_len) == (spec.model_name, 2048)
    assert (config.max_body_bytes, config.max_concurrent_requests, config.max_queued_requests) == (4096, 8, 2)
    assert config.api_key_env == ("PD_KEY", "PD_KEY_2") and config.api_key_file is None
    assert config.admin_key_env == () and config.admin_key_file == "/etc/pdserve/admin-keys"
    assert config.forward_authorization is False and config.engine_auth is True  # engines take the cluster's key
    assert config.bind_reader is True  # the pdserve connector's ids are the pool's engine ids
    assert pickle.loads(pickle.dumps(config)) == config  # it travels to the proxy's Ray actor


def test_forwarding_client_keys_to_a_clusters_engines_is_refused(load):
    with pytest.raises(SpecError, match="proxy.forward_authorization: .*accept only the cluster's engine key"):
        load(proxy={"forward_authorization": True})


def test_proxy_defaults_need_no_key_and_set_no_concurrency_limit(load):
    config = load().proxy_config()

    assert config.api_key_env == () and config.admin_key_env == () and config.max_concurrent_requests is None
    assert config.forward_authorization is False


@pytest.mark.parametrize(
    ("proxy", "field"),
    [
        ({"api_key_env": ["sk-live-1234"]}, "proxy.api_key_env.0"),
        ({"admin_key_env": ["has space"]}, "proxy.admin_key_env.0"),
        ({"max_concurrent_requests": 0}, "proxy.max_concurrent_requests"),
        ({"max_queued_requests": -1}, "proxy.max_queued_requests"),
        ({"max_body_bytes": 10}, "proxy.max_body_bytes"),
    ],
)
def test_bad_proxy_settings_are_named(rejected, make_spec, proxy, field):
    _, err = rejected(make_spec(proxy=proxy))

    assert f"{field}: " in str(err)


def test_served_model_name_overrides_the_name_clients_use(load):
    assert load(served_model_name="smol").model_name == "smol"


def test_model_may_be_an_existing_directory(load, tmp_path: Path):
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()

    assert load(model=str(model_dir)).model == str(model_dir)


def test_model_may_be_a_hugging_face_id_passed_through(load):
    assert load(model="HuggingFaceTB/SmolLM2-135M-Instruct").model == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_replica_port_ranges_that_only_touch_are_fine(load):
    spec = load(prefill={"replicas": 2, "port": 8100}, decode={"port": 8102})

    assert spec.prefill.ports() == [8100, 8101] and spec.decode.ports() == [8102]


def test_tensor_parallel_kv_ports_are_spaced_by_tp_size(load):
    spec = load(prefill={"replicas": 2, "tensor_parallel_size": 2}, resources={"cpus": 8})

    assert spec.prefill.kv_ports() == [5600, 5602]


def test_cuda_spec_with_enough_gpus_is_valid(load):
    spec = load(device="cuda", prefill={"tensor_parallel_size": 2}, resources={"gpus": 3})

    assert spec.device == "cuda"


# --- keys, types and values -------------------------------------------------------------------


def test_unknown_top_level_key_is_named(rejected, make_spec):
    path, err = rejected(make_spec(modle="typo"))

    assert str(err) == f"{path}: modle: unknown key"
    assert (err.source, err.field, err.reason) == (path, "modle", "unknown key")


def test_unknown_nested_key_is_named_with_its_dotted_path(rejected, make_spec):
    path, err = rejected(make_spec(prefill={"replica": 2}))

    assert str(err) == f"{path}: prefill.replica: unknown key"


def test_every_problem_is_listed_one_per_line(rejected, make_spec):
    path, err = rejected(make_spec(modle="typo", decode={"replicas": "two"}))

    lines = str(err).splitlines()
    assert len(lines) == 2
    assert f"{path}: modle: unknown key" in lines
    assert any(line.startswith(f"{path}: decode.replicas: ") for line in lines)
    assert {err.field, *(field for field, _ in err.more)} == {"modle", "decode.replicas"}


def test_wrong_type_names_the_field_and_echoes_the_value(rejected, make_spec):
    path, err = rejected(make_spec(prefill={"replicas": "two"}))

    assert str(err).startswith(f"{path}: prefill.replicas: ")
    assert "valid integer" in err.reason
    assert "(got 'two')" in err.reason


def test_zero_replicas_is_rejected(rejected, make_spec):
    path, err = rejected(make_spec(decode={"replicas": 0}))

    assert str(err) == f"{path}: decode.replicas: Input should be greater than or equal to 1 (got 0)"


def test_unknown_device_is_rejected(rejected, make_spec):
    path, err = rejected(make_spec(device="tpu"))

    assert str(err).startswith(f"{path}: device: ")
    assert "'cpu'" in err.reason and "'cuda'" in err.reason and "(got 'tpu')" in err.reason


def test_cluster_name_must_be_a_plain_word(rejected, make_spec):
    path, err = rejected(make_spec(name="my cluster"))

    assert str(err).startswith(f"{path}: name: String should match pattern")
    assert "(got 'my cluster')" in str(err)


def test_missing_required_section_says_required(rejected, make_spec):
    content = make_spec()
    del content["decode"]

    path, err = rejected(content)

    assert str(err) == f"{path}: decode: required field is missing (or list the cluster's `models`)"


def test_missing_required_nested_field_says_required(rejected, make_spec):
    content = make_spec()
    del content["prefill"]["kv_port"]

    path, err = rejected(content)

    assert str(err) == f"{path}: prefill.kv_port: required field is missing"


def test_section_that_is_not_a_mapping_is_named(rejected, make_spec):
    path, err = rejected(make_spec(engine=[1, 2]))

    assert str(err).startswith(f"{path}: engine: Input should be a valid dictionary")


# --- ports --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        pytest.param(
            {"proxy": {"port": 8100}},
            "prefill.port: port 8100 is also used by proxy.port",
            id="proxy-port-is-prefill-port",
        ),
        pytest.param(
            {"prefill": {"kv_port": 8200}},
            "decode.port: port 8200 is also used by prefill.kv_port",
            id="prefill-kv-port-is-decode-port",
        ),
        pytest.param(
            {"prefill": {"replicas": 2, "port": 8100}, "decode": {"port": 8101}},
            "decode.port: port 8101 is also used by prefill.port",
            id="prefill-replica-range-covers-decode-port",
        ),
        pytest.param(
            {"prefill": {"replicas": 2, "kv_port": 5700}, "decode": {"kv_port": 5701}},
            "decode.kv_port: port 5701 is also used by prefill.kv_port",
            id="kv-port-ranges-overlap",
        ),
        pytest.param(
            {"prefill": {"tensor_parallel_size": 2, "kv_port": 5600}, "decode": {"kv_port": 5601}},
            "decode.kv_port: port 5601 is also used by prefill.kv_port",
            id="tp-ranks-use-consecutive-kv-ports",
        ),
        pytest.param(
            {"prefill": {"port": 5600}},
            "prefill.kv_port: port 5600 is also used by prefill.port",
            id="same-port-within-one-pool",
        ),
    ],
)
def test_port_used_twice_names_both_owners(rejected, make_spec, overrides, expected):
    path, err = rejected(make_spec(**overrides))

    assert str(err) == f"{path}: {expected}"


def test_port_above_65535_after_adding_replicas(rejected, make_spec):
    path, err = rejected(make_spec(decode={"replicas": 3, "port": 65534}))

    assert str(err) == f"{path}: decode.port: port 65536 of its replicas is above 65535"


def test_kv_port_above_65535_after_adding_replicas(rejected, make_spec):
    path, err = rejected(make_spec(prefill={"replicas": 2, "kv_port": 65535}))

    assert str(err) == f"{path}: prefill.kv_port: port 65536 of its replicas is above 65535"


def test_proxy_routing_reaches_the_proxys_settings(load):
    spec = load(
        proxy={
            "routing": {"prefill": "prefix_aware", "decode": "least_loaded", "prefix_block_chars": 64},
            "decode_only_below_tokens": 32,
            "health_interval_s": 0.5,
            "unhealthy_after": 2,
            "prefill_retries": 0,
            "decode_retries": 2,
        }
    )
    settings = spec.proxy_config()

    assert (settings.routing.prefill, settings.routing.decode) == ("prefix_aware", "least_loaded")
    assert (settings.routing.prefix_block_chars, settings.decode_only_below_tokens) == (64, 32)
    assert (settings.health_interval_s, settings.unhealthy_after, settings.prefill_retries) == (0.5, 2, 0)
    assert settings.decode_retries == 2
    assert settings.healthy_after == 2  # a default


def test_proxy_routing_defaults_are_round_robin_and_always_disaggregated(load):
    settings = load().proxy_config()

    assert (settings.routing.prefill, settings.routing.decode, settings.decode_only_below_tokens) == (
        "round_robin",
        "round_robin",
        0,
    )


@pytest.mark.parametrize(
    ("proxy", "field"),
    [
        ({"routing": {"prefill": "random"}}, "proxy.routing.prefill"),
        ({"routing": {"decode": "fastest"}}, "proxy.routing.decode"),
        ({"routing": {"policy": "round_robin"}}, "proxy.routing.policy"),
        ({"unhealthy_after": 0}, "proxy.unhealthy_after"),
        ({"decode_only_below_tokens": -1}, "proxy.decode_only_below_tokens"),
        ({"routing": {"prefix_overload_factor": 0.5}}, "proxy.routing.prefix_overload_factor"),
    ],
)
def test_proxy_routing_is_validated(rejected, make_spec, proxy, field):
    path, err = rejected(make_spec(proxy=proxy))

    assert str(err).startswith(f"{path}: {field}: ")


def test_port_out_of_range_on_its_own(rejected, make_spec):
    path, err = rejected(make_spec(proxy={"port": 70000}))

    assert str(err) == f"{path}: proxy.port: Input should be less than or equal to 65535 (got 70000)"


# --- resources ----------------------------------------------------------------------------------


def test_cpu_cores_over_budget_gives_the_numbers(rejected, make_spec):
    path, err = rejected(make_spec(prefill={"replicas": 2}, resources={"cpus": 2}))

    message = str(err)
    assert message.startswith(f"{path}: ")
    assert "engines need 3 CPU cores" in message
    assert "only 2 are available" in message
    assert "resources.cpus" in message


def test_cpu_budget_counts_tensor_parallel_ranks_and_cores(rejected, make_spec):
    path, err = rejected(make_spec(decode={"tensor_parallel_size": 2, "cpu_cores": 2}, resources={"cpus": 4}))

    assert "engines need 5 CPU cores" in str(err) and "only 4 are available" in str(err)


def test_cpu_budget_defaults_to_the_machine(rejected, make_spec, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)

    path, err = rejected(make_spec(decode={"cpu_cores": 2}))

    assert "engines need 3 CPU cores" in str(err) and "only 2 are available" in str(err)


def test_cpu_budget_is_not_checked_on_cuda(load):
    spec = load(device="cuda", prefill={"cpu_cores": 64}, resources={"cpus": 1, "gpus": 2})

    assert spec.device == "cuda"


def test_cuda_tensor_parallel_larger_than_gpus_names_the_pool(rejected, make_spec):
    path, err = rejected(make_spec(device="cuda", prefill={"tensor_parallel_size": 2}, resources={"gpus": 1}))

    assert str(err) == (
        f"{path}: prefill.tensor_parallel_size: TP size 2 needs 2 GPUs per engine but resources.gpus is 1"
    )


def test_cuda_without_gpus_is_rejected(rejected, make_spec):
    path, err = rejected(make_spec(device="cuda"))

    assert str(err) == (
        f"{path}: prefill.tensor_parallel_size: TP size 1 needs 1 GPUs per engine but resources.gpus is 0"
    )


def test_cuda_engines_together_need_more_gpus_than_available(rejected, make_spec):
    # Each engine fits, but prefill (2 x TP 1) + decode (TP 1) need 3 GPUs: the third would never start.
    path, err = rejected(make_spec(device="cuda", prefill={"replicas": 2}, resources={"gpus": 2}))

    assert str(err) == (
        f"{path}: resources.gpus: engines need 3 GPUs (replicas x tensor_parallel_size, both pools) "
        "but resources.gpus is 2"
    )


# --- model --------------------------------------------------------------------------------------


def test_model_path_that_does_not_exist(rejected, make_spec, tmp_path: Path):
    missing = tmp_path / "no-such-model"

    path, err = rejected(make_spec(model=str(missing)))

    assert str(err) == f"{path}: model: model directory {str(missing)!r} does not exist"


def test_model_path_that_is_a_file_is_rejected(rejected, make_spec, tmp_path: Path):
    weights = tmp_path / "model.safetensors"
    weights.write_text("")

    path, err = rejected(make_spec(model=str(weights)))

    assert err.field == "model" and "does not exist" in err.reason


def test_known_model_not_prepared_says_to_run_make_setup(rejected, make_spec, monkeypatch, tmp_path: Path):
    empty_cache = tmp_path / "empty-cache"
    empty_cache.mkdir()
    monkeypatch.setenv("PDSERVE_MODEL_CACHE", str(empty_cache))

    path, err = rejected(make_spec(model="smollm2-135m-instruct"))

    message = str(err)
    assert message.startswith(f"{path}: model: 'smollm2-135m-instruct' is not prepared in {empty_cache}")
    assert "make setup" in message


def test_shipped_spec_needs_the_model_prepared(local_cpu_spec: Path, monkeypatch, tmp_path: Path):
    monkeypatch.setenv("PDSERVE_MODEL_CACHE", str(tmp_path / "nothing-here"))

    with pytest.raises(SpecError) as info:
        ClusterSpec.from_file(local_cpu_spec)

    assert str(info.value).startswith(f"{local_cpu_spec}: model: ")
    assert "make setup" in str(info.value)


# --- the file itself ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content", ["- a\n- list\n", "just a string\n", "42\n", ""], ids=["list", "string", "number", "empty-file"]
)
def test_file_that_is_not_a_mapping(rejected, content: str):
    path, err = rejected(content)

    assert str(err) == f"{path}: the file must hold a YAML mapping"
    assert err.field == ""


def test_invalid_yaml_names_the_file(rejected):
    path, err = rejected("prefill: {port: 8100\ndecode: [\n")

    assert str(err).startswith(f"{path}: not valid YAML: ")
    assert err.field == ""


def test_missing_file_names_the_file(tmp_path: Path):
    missing = tmp_path / "nope.yaml"

    with pytest.raises(SpecError) as info:
        ClusterSpec.from_file(missing)

    assert str(info.value) == f"{missing}: cannot read file: No such file or directory"


def test_from_dict_names_its_source(make_spec):
    with pytest.raises(SpecError) as info:
        ClusterSpec.from_dict(make_spec(decode={"replicas": 0}), source="inline")

    assert str(info.value).startswith("inline: decode.replicas: ")


# --- the error object ---------------------------------------------------------------------------


def test_spec_error_is_a_pdserve_error(rejected, make_spec):
    _, err = rejected(make_spec(modle="typo"))

    assert isinstance(err, PdserveError)


def test_spec_error_survives_pickling(rejected, make_spec):
    # It crosses Ray's process boundary (controller actor -> CLI) by pickle.
    _, err = rejected(make_spec(modle="typo", prefill={"replicas": 0}))

    copy = pickle.loads(pickle.dumps(err))

    assert type(copy) is SpecError
    assert (copy.source, copy.field, copy.reason, copy.more) == (err.source, err.field, err.reason, err.more)
    assert str(copy) == str(err)


def test_spec_is_frozen(load):
    spec = load()

    with pytest.raises(ValueError):
        spec.prefill.replicas = 3  # type: ignore[misc]


def test_share_cores_admits_more_engines_than_cores(load):
    spec = load(decode={"tensor_parallel_size": 2}, resources={"cpus": 2, "share_cores": True})

    assert placement.cpu_cores_needed(spec) == 3


# --- autoscaling ------------------------------------------------------------------------------

AUTOSCALING = {
    "prefill": {"min": 1, "max": 4},
    "decode": {"min": 1, "max": 4},
    "max_engines": 6,
    "targets": {"ttft_p90_s": 2.0, "itl_p90_s": 0.05},
}


def test_autoscaling_section_loads_with_defaults(load):
    spec = load(autoscaling=AUTOSCALING)

    assert spec.autoscaling.max_engines == 6 and spec.autoscaling.interval_s == 30.0
    assert spec.autoscaling.targets.itl_p90_s == 0.05


def test_shipped_autoscaling_sim_spec_loads():
    spec = ClusterSpec.from_file(Path(__file__).resolve().parents[3] / "configs" / "autoscaling-sim.yaml")

    assert spec.autoscaling.max_engines == 64
    assert spec.profile_path("configs/autoscaling-sim.yaml") == Path("configs/profiles/example-gpu.yaml")


@pytest.mark.parametrize(
    ("override", "field", "reason"),
    [
        ({"prefill": {"min": 5, "max": 4}}, "autoscaling.prefill.min", "min 5 is above max 4"),
        (
            {"max_engines": 2, "prefill": {"min": 2, "max": 4}},
            "autoscaling.max_engines",
            "below the pools' minimums together",
        ),
        ({"targets": {"ttft_p90_s": 0}}, "autoscaling.targets.ttft_p90_s", "greater than 0"),
        ({"cooldown": 3}, "autoscaling.cooldown", "unknown key"),
    ],
)
def test_bad_autoscaling_names_the_field(rejected, make_spec, override, field, reason):
    path, err = rejected(make_spec(autoscaling={**AUTOSCALING, **override}))

    assert err.field == field and reason in err.reason
    assert str(err).startswith(f"{path}: {field}: ")


def test_starting_replicas_must_be_inside_the_autoscaling_range(rejected, make_spec):
    path, err = rejected(make_spec(prefill={"replicas": 5}, autoscaling=AUTOSCALING, resources={"cpus": 8}))

    assert err.field == "prefill.replicas" and "outside autoscaling.prefill's range 1..4" in err.reason


def test_autoscaling_on_cuda_must_fit_the_gpus(rejected, make_spec):
    path, err = rejected(make_spec(device="cuda", resources={"gpus": 4}, autoscaling=AUTOSCALING))

    assert err.field == "autoscaling.max_engines" and "need 6 GPUs but resources.gpus is 4" in err.reason


@pytest.mark.parametrize("config", sorted(Path("configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_is_valid_and_its_profile_loads(config: Path, model_cache: Path) -> None:
    from orchestrator.cluster import autoscaling_profile
    from orchestrator.models import KNOWN_MODELS, TINY_MODEL_NAME

    (model_cache / KNOWN_MODELS[TINY_MODEL_NAME].dir_name).mkdir()  # make setup prepares it too
    for view in ClusterSpec.from_file(config).views():
        profile = autoscaling_profile(view, str(config))
        if view.autoscaling is not None and view.autoscaling.profile is not None:
            assert profile is not None and profile["engine"]["max_num_batched_tokens"] > 0
        else:
            assert profile is None
