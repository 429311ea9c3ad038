"""Our connector's options: one pydantic model, owned here, and what the connector reads back.

``ConnectorOptions`` is the whole definition of every option (type, default,
range, description). The cluster spec embeds it (``connector_options``); the
orchestrator writes it, with the engine's side channel, into each engine's
``kv_transfer_config.kv_connector_extra_config``; the connector reads that
back as ``ConnectorSettings`` (the same model and the side channel), so an
option is written once and checked the same way on both sides. Nothing here
imports vLLM or torch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from connectors.transport import CONFIGURABLE, DEFAULT_TRANSPORTS

__all__ = ["ConnectorOptions", "ConnectorSettings", "FaultInjection"]

logger = logging.getLogger(__name__)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FaultInjection(_Strict):
    """Faults the ``pdserve`` connector injects on purpose, so tests can prove it survives them."""

    read_failure_rate: float = Field(
        default=0.0, ge=0, le=1, description="Fraction of KV reads on decode engines that fail (then recompute)."
    )
    handshake_delay_s: float = Field(
        default=0.0, ge=0, description="Seconds a prefill engine waits before answering each handshake."
    )
    read_hold_s: float = Field(
        default=0.0,
        ge=0,
        description="Seconds a decode engine waits between pinning a prefill engine's blocks and posting its KV "
        "read (a slow read: what happens meanwhile, a release, a flood, is what tests look at).",
    )
    seed: int | None = Field(default=None, description="Seed of the failure draw (default: random).")


class ConnectorOptions(_Strict):
    """Settings of our own connector (``connector: pdserve``)."""

    lease_ttl_s: float = Field(
        default=120.0, gt=0, description="Prefill engines free KV blocks nobody read (or released) after this."
    )
    handshake_timeout_s: float = Field(
        default=5.0, gt=0, description="A decode engine gives up on an unreachable prefill engine after this."
    )
    transfer_timeout_s: float = Field(default=30.0, gt=0, description="A KV read that takes longer fails.")
    read_margin_s: float = Field(
        default=2.0,
        ge=0,
        description="A KV read must end this long before the prefill's lease on the blocks does (the most the "
        "clocks of two hosts may differ); one that cannot is recomputed, never served from blocks that may be "
        "another request's.",
    )
    load_wait_s: float = Field(
        default=0.01,
        ge=0,
        le=1,
        description="After a step's forward, a decode engine waits up to this long for the KV loads the step "
        "began (a pin's round trip and a READ: a few ms on one host) before it reports which landed, so their "
        "requests join the next step instead of the one after; 0: never waits.",
    )
    transports: tuple[Literal[CONFIGURABLE], ...] = Field(  # type: ignore[valid-type]
        default=DEFAULT_TRANSPORTS,
        min_length=1,
        description="KV transports engines serve and read over, best first: cuda-ipc moves KV device to device "
        "between engines whose GPU one of them sees (it stands aside on CPU caches); nixl everywhere else.",
    )
    fault_injection: FaultInjection = Field(
        default_factory=FaultInjection, description="Failures to inject, for tests of what a failure costs (off)."
    )


class ConnectorSettings(ConnectorOptions):
    """What one engine's connector runs with: the options, and where its side channel listens.

    Keys it does not know are logged and left alone (vLLM or a connector beside ours may add its own to the
    extra config); the cluster spec, where users write options, refuses them.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    side_channel_host: str = Field(min_length=1, description="Address the side channel binds.")
    side_channel_port: int = Field(ge=1, le=65535, description="Port of TP rank 0's side channel (rank r: + r).")

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, Any] | None, engine_id: str) -> ConnectorSettings:
        """The settings in ``kv_connector_extra_config``; ``ValueError`` naming the engine and each bad field."""
        extra = dict(extra_config or {})
        unknown = sorted(set(extra) - set(cls.model_fields))
        if unknown:
            logger.warning("engine %s: kv_connector_extra_config keys %s are not ours; ignored", engine_id, unknown)
        try:
            return cls.model_validate(extra)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(part) for part in error['loc']) or 'config'}: {error['msg']}" for error in e.errors()
            )
            raise ValueError(f"kv_connector_extra_config of engine {engine_id}: {problems}") from None
