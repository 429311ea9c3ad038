"""How one request's prompt KV reached its decode engine: the report a decode engine gives and the proxy tells.

A decode engine running the ``pdserve`` connector makes one ``KVReport`` per
request and TP rank (``source``: ``transfer``, ``recomputed``,
``local_prefix_cache`` or ``none``). Ranks' parts of one request are merged with
``merge``, wherever they meet (the engine's scheduler side, across steps; the
proxy, across a stream's side-channel answers): bytes add up, the slowest rank's
time counts, a recompute wins with its reason. The report travels as a dict
(``as_dict``: in the answer's ``kv_transfer_params["pdserve_kv"]``, and as JSON on
the side channel) and reaches the client as the ``X-PDServe-KV`` header
(``header``). ``from_dict`` reads what a peer sent and never raises.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["HEADER_KEYS", "KVReport"]

HEADER_KEYS = ("source", "bytes", "transfer_ms", "transport", "reason", "remote_engine_id")
"""The fields the header carries, in its order (``detail`` and ``remote_ranks`` stay in the JSON answer)."""


@dataclasses.dataclass(frozen=True, slots=True)
class KVReport:
    """One request's KV load on one decode rank, or merged over its ranks; None and "" mean not said."""

    source: str
    bytes: int | None = None
    transfer_ms: float | None = None
    transport: str = ""
    reason: str = ""
    detail: str = ""
    remote_engine_id: str = ""
    remote_ranks: tuple[int, ...] = ()

    @classmethod
    def transfer(
        cls, num_bytes: int, transfer_ms: float, transport: str, remote_engine_id: str, remote_ranks: Iterable[int]
    ) -> KVReport:
        return cls("transfer", num_bytes, transfer_ms, transport, remote_engine_id=remote_engine_id,
                   remote_ranks=tuple(remote_ranks))  # fmt: skip

    @classmethod
    def recomputed(cls, reason: str, detail: str = "", remote_engine_id: str = "") -> KVReport:
        return cls("recomputed", reason=reason, detail=detail[:200], remote_engine_id=remote_engine_id)

    def merge(self, other: KVReport) -> KVReport:
        """The report of both parts: bytes add up, the slowest time counts, a recompute wins (with its reason)."""
        first, second = (other, self) if other.source == "recomputed" and self.source != "recomputed" else (self, other)
        sizes = [part.bytes for part in (self, other) if part.bytes is not None]
        times = [part.transfer_ms for part in (self, other) if part.transfer_ms is not None]
        num_bytes = sum(sizes) if sizes else None
        transfer_ms = max(times) if times else None
        if first.source == "recomputed" and not num_bytes:
            num_bytes = transfer_ms = None
        return dataclasses.replace(
            first,
            bytes=num_bytes,
            transfer_ms=transfer_ms,
            transport=first.transport or second.transport,
            remote_engine_id=first.remote_engine_id or second.remote_engine_id,
            remote_ranks=first.remote_ranks + tuple(r for r in second.remote_ranks if r not in first.remote_ranks),
        )

    @classmethod
    def merge_all(cls, parts: Iterable[KVReport]) -> KVReport:
        merged: KVReport | None = None
        for part in parts:
            merged = part if merged is None else merged.merge(part)
        if merged is None:
            raise ValueError("no report to merge")
        return merged

    def as_dict(self) -> dict[str, Any]:
        """The JSON form: the fields that say something."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and value != "" and value != ():
                out[field.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: object) -> KVReport | None:
        """A report a peer sent (``as_dict``'s form), or None if it is not one; never raises."""
        if not isinstance(data, Mapping) or not isinstance(source := data.get("source"), str) or not source:
            return None
        try:
            ranks = data.get("remote_ranks") or ()
            return cls(
                source,
                None if data.get("bytes") is None else int(data["bytes"]),
                None if data.get("transfer_ms") is None else float(data["transfer_ms"]),
                *(str(data.get(key) or "") for key in ("transport", "reason", "detail", "remote_engine_id")),
                remote_ranks=tuple(int(rank) for rank in ranks),
            )
        except (TypeError, ValueError):
            return None

    def header(self) -> str:
        """The ``X-PDServe-KV`` value: ``key=value`` pairs of the fields that say something."""
        fields = self.as_dict()
        return "; ".join(f"{key}={fields[key]}" for key in HEADER_KEYS if key in fields)
