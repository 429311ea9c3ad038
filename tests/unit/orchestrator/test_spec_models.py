"""A spec of several models (``ClusterSpec.models``): each model's view is a one-model spec with the cluster's
shared settings; engine ids, cores, ports, KV tier directories and GPUs are planned across the models; what is
wrong names the model's entry; a one-model spec is unchanged."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from orchestrator.errors import SpecError
from orchestrator.launch import plan_engines
from orchestrator.spec import ClusterSpec
from tests.unit.conftest import BASE_SPEC, spec_dict

DEMO = BASE_SPEC["model"]
OTHER = "/models/other"  # a directory (made by the fixture below)


@pytest.fixture(autouse=True)
def other_model(tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    global OTHER
    OTHER = str(tmp_path / "other")


def two_models(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "two",
        "resources": {"cpus": 4},
        "models": [
            {"model": DEMO, "prefill": {"port": 8100, "kv_port": 5600}, "decode": {"port": 8200, "kv_port": 5700}},
            {
                "model": OTHER,
                "served_model_name": "other",
                "prefill": {"port": 8110, "kv_port": 5610},
                "decode": {"port": 8210, "kv_port": 5710},
                "routing": {"decode": "least_loaded"},
                "engine": {"max_model_len": 512},
            },
        ],
    }
    for key, value in overrides.items():
        spec[key] = copy.deepcopy(value)
    return spec


def refusal(data: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as err:
        ClusterSpec.from_dict(data, source="two.yaml")
    return str(err.value)


def test_each_model_is_a_view_with_its_own_pools_engines_and_routing() -> None:
    spec = ClusterSpec.from_dict(two_models())
    demo, other = spec.views()
    assert (demo.model_name, demo.key, other.model_name, other.key) == (DEMO, DEMO, "other", "other")
    assert other.engine.max_model_len == 512 and demo.engine.max_model_len == 4096
    assert other.proxy.routing.decode == "least_loaded" and demo.proxy.routing.decode == "round_robin"
    assert [(c.model_name, c.max_model_len) for c in spec.proxy_configs()] == [(DEMO, 4096), ("other", 512)]

    launches = plan_engines(spec)

    assert [(e.engine_id, e.model, e.port, e.cpu_bind) for e in launches] == [
        (f"{DEMO}-prefill-0", DEMO, 8100, "0"),
        (f"{DEMO}-decode-0", DEMO, 8200, "1"),
        ("other-prefill-0", "other", 8110, "2"),  # the cores after the first model's
        ("other-decode-0", "other", 8210, "3"),
    ]
    other_args = launches[2].vllm_args
    assert other_args[other_args.index("--served-model-name") + 1] == "other"
    assert other_args[other_args.index("--model") + 1] == OTHER


def test_a_one_model_spec_is_its_own_only_view() -> None:
    spec = ClusterSpec.from_dict(spec_dict())
    assert spec.views() == [spec] and spec.key == ""
    assert [e.engine_id for e in plan_engines(spec)] == ["prefill-0", "decode-0"]


def test_each_models_kv_tier_has_its_own_directories(tmp_path: Path) -> None:
    tier = {"node_gib": 0.5, "shared_path": str(tmp_path / "tier")}
    demo, other = ClusterSpec.from_dict(two_models(kv_tier=tier)).views()
    assert demo.kv_tier_paths() == (Path("/dev/shm/pdserve-kv/two", DEMO), tmp_path / "tier" / DEMO)
    assert other.kv_tier_paths()[1] == tmp_path / "tier" / "other"


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda s: s | {"model": DEMO}, "two.yaml: model: a spec of several models sets it per model"),
        (lambda s: s | {"engine": {"max_model_len": 64}}, "two.yaml: engine: a spec of several models sets it"),
        (
            lambda s: s | {"models": [s["models"][0], s["models"][0] | {"prefill": {"port": 8300, "kv_port": 5800}}]},
            f"two.yaml: models.1: its key {DEMO!r} is also models.0's",
        ),
        (
            lambda s: s | {"models": [s["models"][0], s["models"][1] | {"decode": {"port": 8100, "kv_port": 5910}}]},
            "two.yaml: models.1.decode.port: port 8100 is also used by models.0.prefill.port",
        ),
        (
            lambda s: s | {"models": [s["models"][0], s["models"][1] | {"prefill": {"port": 8110}}]},
            "two.yaml: models.1.prefill.kv_port: required field is missing",
        ),
        (lambda s: s | {"resources": {"cpus": 3}}, "two.yaml: resources.cpus: engines need 4 CPU cores"),
        (lambda s: s | {"models": []}, "two.yaml: models: List should have at least 1 item"),
    ],
    ids=["model-beside-models", "engine-beside-models", "same-key", "port-clash", "entry-field", "cores", "empty"],
)
def test_what_is_wrong_names_the_models_entry(change, said) -> None:
    assert refusal(change(two_models())).startswith(said)


def test_a_model_field_missing_in_a_view_is_named_in_its_entry() -> None:
    data = two_models()
    data["models"][1]["engine"] = {"max_model_len": 8}  # below the minimum
    assert refusal(data).startswith("two.yaml: models.1.engine.max_model_len:")


def test_the_models_gpus_add_up() -> None:
    for entry in (models := two_models(device="cuda", resources={"gpus": 3})["models"]):
        entry["decode"]["tensor_parallel_size"] = 1
    fits = two_models(device="cuda", resources={"gpus": 4}, models=models)
    assert len(plan_engines(ClusterSpec.from_dict(fits))) == 4
    said = refusal(two_models(device="cuda", resources={"gpus": 3}, models=models))
    assert said.startswith("two.yaml: resources.gpus: the models' engines need 4 GPUs together")


def test_an_adapter_may_not_take_a_models_name() -> None:
    data = two_models()
    data["models"][1]["engine"] = {"lora_adapters": {DEMO: "/adapters/x"}}
    assert refusal(data).startswith(f"two.yaml: models.1.engine.lora_adapters: {DEMO!r} names another model")


@pytest.mark.parametrize(
    ("adapters", "said"),
    [
        (
            ({"other": "/adapters/x"}, {}),
            "models.0.engine.lora_adapters: 'other' names another model too: models.1's served name",
        ),
        (({}, {"other": "/adapters/x"}), "models.1.engine.lora_adapters: 'other' names the model itself"),
        (
            ({"shared": "/adapters/x"}, {"shared": "/adapters/y"}),
            "models.1.engine.lora_adapters: 'shared' names another model too: an adapter of models.0",
        ),
    ],
    ids=["a-later-models-name", "its-own-models-name", "another-models-adapter"],
)
def test_an_adapters_name_is_taken_by_nothing_else_whichever_is_listed_first(adapters, said) -> None:
    """The proxy maps every served name and adapter to one model's pools: a name taken twice would send one
    model's requests to another's engines."""
    data = two_models()
    for entry, entry_adapters in zip(data["models"], adapters, strict=True):
        entry["engine"] = entry.get("engine", {}) | {"lora_adapters": entry_adapters}
    assert refusal(data).startswith(f"two.yaml: {said}")


def test_a_single_models_adapter_may_not_take_its_name() -> None:
    with pytest.raises(SpecError) as err:
        ClusterSpec.from_dict(spec_dict(engine={"lora_adapters": {DEMO: "/adapters/x"}}), source="one.yaml")
    assert str(err.value).startswith(f"one.yaml: engine.lora_adapters: {DEMO!r} names the model itself")


def test_a_command_of_one_model_takes_the_view_it_names() -> None:
    from orchestrator.autoscale.profiler_http import ClusterEndpoints
    from orchestrator.errors import PdserveError

    spec = ClusterSpec.from_dict(two_models())
    assert spec.view("other") is spec.views()[1] and spec.view(DEMO) is spec.views()[0]
    with pytest.raises(PdserveError, match=f"name the model \\(--model\\): one of {DEMO}, other"):
        spec.view(None)
    with pytest.raises(PdserveError, match="no model 'big'"):
        spec.view("big")

    engines = [
        {"engine_id": f"{key}-{role}-0", "model": model, "role": role, "state": "ready", "url": f"http://{key}-{role}"}
        for key, model in ((DEMO, DEMO), ("other", "other"))
        for role in ("prefill", "decode")
    ]
    status = {
        "name": "two",
        "model": f"{DEMO}, other",
        "connector": "pdserve",
        "proxy_url": "http://p",
        "engines": engines,
    }
    measured = ClusterEndpoints.from_status(status, model="other")
    assert (measured.model, measured.prefill_pool, measured.decode_pool) == (
        "other", ("http://other-prefill",), ("http://other-decode",)
    )  # fmt: skip
