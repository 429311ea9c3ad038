"""The connector's options: one model, written by the orchestrator and read back by the connector."""

from __future__ import annotations

import pytest

from connectors.options import ConnectorOptions, ConnectorSettings
from orchestrator.spec import ClusterSpec

SIDE_CHANNEL = {"side_channel_host": "127.0.0.1", "side_channel_port": 17600}


def test_the_cluster_spec_embeds_the_connectors_own_model():
    assert ClusterSpec.model_fields["connector_options"].annotation == ConnectorOptions | None
    assert issubclass(ConnectorSettings, ConnectorOptions)
    assert set(ConnectorSettings.model_fields) == set(ConnectorOptions.model_fields) | set(SIDE_CHANNEL)


def test_what_the_orchestrator_writes_the_connector_reads_back():
    options = ConnectorOptions(lease_ttl_s=7, transports=("nixl",), fault_injection={"read_failure_rate": 0.5})
    settings = ConnectorSettings.from_extra_config({**SIDE_CHANNEL, **options.model_dump()}, "prefill-0")
    assert ConnectorOptions(**settings.model_dump(exclude=set(SIDE_CHANNEL))) == options
    assert settings.side_channel_port == 17600


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"side_channel_host": "127.0.0.1"}, "side_channel_port: Field required"),
        ({**SIDE_CHANNEL, "side_channel_port": 70000}, "side_channel_port: Input should be less than or equal"),
        ({**SIDE_CHANNEL, "fault_injection": {"read_failure_rate": 2}}, "fault_injection.read_failure_rate"),
        ({**SIDE_CHANNEL, "transports": ["rdma-magic"]}, "transports.0"),
        ({**SIDE_CHANNEL, "transports": []}, "transports: Tuple should have at least 1 item"),
        ({**SIDE_CHANNEL, "fault_injection": {"read_failure": 1}}, "fault_injection.read_failure: Extra inputs"),
    ],
)
def test_a_bad_extra_config_names_the_engine_and_the_field(extra: dict, named: str):
    with pytest.raises(ValueError, match="kv_connector_extra_config of engine decode-1") as raised:
        ConnectorSettings.from_extra_config(extra, "decode-1")
    assert named in str(raised.value)


def test_keys_of_others_in_the_extra_config_are_logged_and_left_alone(caplog: pytest.LogCaptureFixture):
    settings = ConnectorSettings.from_extra_config({**SIDE_CHANNEL, "handshake_port": 5}, "decode-1")
    assert settings == ConnectorSettings(**SIDE_CHANNEL)
    assert "keys ['handshake_port'] are not ours" in caplog.text
