"""One definition of each setting: the spec embeds the components' models, the flags and docs come from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator import reference
from orchestrator.cli import build_parser, main
from orchestrator.cli.proxy import proxy_settings
from orchestrator.errors import SpecError
from orchestrator.model_flags import model_flags
from orchestrator.spec import ClusterSpec
from orchestrator.spec_sections import ProxySpec
from proxy.config import ProxySettings

ROOT = Path(__file__).resolve().parents[3]
ENGINES = ["proxy", "--prefill", "http://p:1", "--decode", "http://d:1"]


def leaves(model) -> set[str]:
    return {".".join(flag.path) for flag in model_flags(model)}


def test_the_spec_and_the_standalone_proxy_take_the_same_settings():
    every = [*ENGINES, "--config", "/dev/null"]
    defaults = vars(build_parser("proxy").parse_args(every))
    assert not any(dest.startswith("model_flag:") for dest in defaults)  # a flag not given overrides nothing
    flags = set()
    for flag in model_flags(ProxySettings):
        flags |= {dest.removeprefix("model_flag:") for dest in vars(_given(flag)) if dest.startswith("model_flag:")}

    assert flags == leaves(ProxySettings)
    assert leaves(ProxySpec) - flags == {"placement"}  # where a cluster's proxy runs


def _given(flag):
    """The parsed arguments when ``flag`` is given with its default as value."""
    value = flag.field.get_default(call_default_factory=True)
    if isinstance(value, bool):
        args = [flag.name if value else "--no-" + flag.name.removeprefix("--")]
    elif isinstance(value, tuple):
        args = [flag.name, "X_KEY" if flag.path[-1].endswith("_env") else "10.0.0.0/8"]
    else:
        args = [flag.name, str(1 if value is None else value)]
    return build_parser("proxy").parse_args([*ENGINES, *args])


def test_proxy_help_lists_every_setting(capsys):
    with pytest.raises(SystemExit):
        main(["proxy", "--help"])
    shown = capsys.readouterr().out

    for name in leaves(ProxySettings):
        assert "--" + name.replace(".", "-").replace("_", "-") in shown


def test_config_file_and_flags_over_it(tmp_path: Path):
    config = tmp_path / "proxy.yaml"
    config.write_text("port: 9000\nrouting: {prefill: prefix_aware, prefix_block_chars: 64}\ndegrade: false\n")

    args = build_parser("proxy").parse_args([*ENGINES, "--config", str(config), "--routing-decode", "least_loaded"])
    settings = proxy_settings(args)

    assert (settings.port, settings.degrade) == (9000, False)
    assert settings.routing.model_dump(include={"prefill", "decode", "prefix_block_chars"}) == {
        "prefill": "prefix_aware",
        "decode": "least_loaded",
        "prefix_block_chars": 64,
    }
    over = proxy_settings(build_parser("proxy").parse_args([*ENGINES, "--config", str(config), "--port", "9100"]))
    assert over.port == 9100 and over.routing.prefill == "prefix_aware"


def test_a_bad_config_file_names_the_file_and_the_field(tmp_path: Path, capsys):
    config = tmp_path / "proxy.yaml"
    config.write_text("routing: {prefill: fastest}\nplacement: {node_labels: {a: b}}\n")

    assert main([*ENGINES, "--config", str(config), "--model", "m"]) == 2

    err = capsys.readouterr().err
    assert f"{config}: routing.prefill: Input should be 'round_robin', 'least_loaded' or 'prefix_aware'" in err
    assert f"{config}: placement: unknown key" in err  # a cluster's proxy only


def test_the_cluster_specs_proxy_section_is_the_proxys_settings(make_spec):
    spec = ClusterSpec.from_dict(make_spec(proxy={"routing": {"decode": "least_loaded"}, "decode_retries": 3}))
    config = spec.proxy_config()

    assert (config.routing.decode, config.decode_retries, config.model_name) == ("least_loaded", 3, spec.model_name)
    with pytest.raises(SpecError, match="proxy.port: .*fixed port"):
        ClusterSpec.from_dict(make_spec(proxy={"port": 0}))


def test_autoscaling_errors_name_the_whole_path(make_spec):
    scaling = {
        "prefill": {"min": 3, "max": 2},
        "decode": {"max": 2},
        "max_engines": 4,
        "targets": {"ttft_p90_s": 1, "itl_p90_s": 0.1},
    }
    with pytest.raises(SpecError) as info:
        ClusterSpec.from_dict(make_spec(autoscaling=scaling))
    assert info.value.field == "autoscaling.prefill.min"


@pytest.mark.parametrize("which", reference.SCHEMAS)
def test_schema_prints_a_json_schema_of_every_key(which, capsys):
    assert main(["schema", which]) == 0
    schema = json.loads(capsys.readouterr().out)

    assert schema["$schema"].startswith("https://json-schema.org/")
    assert schema["additionalProperties"] is False
    model = ClusterSpec if which == "cluster" else ProxySettings
    assert set(schema["properties"]) == set(model.model_fields)


def test_the_configuration_reference_is_current():
    page = (ROOT / "docs" / "configuration.md").read_text()

    assert page == reference.markdown(), "regenerate it: pdserve schema --markdown > docs/configuration.md"
    for key in ("`proxy.routing.prefill`", "`autoscaling.targets.ttft_p90_s`", "`connector_options.transports`"):
        assert key in page
