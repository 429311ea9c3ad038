"""``X-PDServe-KV``: how a request's prompt KV reached its decode engine, told to the client.

A decode engine running the ``pdserve`` connector reports its KV load per
request (``source=transfer; bytes=...; transfer_ms=...``, or
``source=recomputed; reason=...``). In a JSON answer the report is in the
response's ``kv_transfer_params["pdserve_kv"]`` (``kv_report``). A stream
carries no ``kv_transfer_params`` (vLLM 0.32), so for a stream the proxy asks
the decode engine's side channel (``proxy.release.ask``; one ``tcp://host:port``
per TP rank, which the orchestrator gives the pool as the engine's
``kv_endpoints``) once the first chunk has come: the KV is loaded by then.
What to send is the prefill engine's business: its ``kv_transfer_params`` carry a ``pdserve_report``
message; each rank answers with its part of the report as JSON (bytes add
up, the slowest rank's time counts, a recompute wins) or ``NONE``. No answer
within ``REPORT_TIMEOUT_S`` leaves the header out; the stream is not held up longer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from connectors import wire
from proxy.release import ask

__all__ = ["KVReports", "format_report", "kv_report"]

logger = logging.getLogger(__name__)

REPORT_TIMEOUT_S = 0.25
HEADER_KEYS = ("source", "bytes", "transfer_ms", "transport", "reason", "remote_engine_id")
_REPORT_KEY = f'"{wire.PDSERVE_KV}"'.encode()


def format_report(report: dict[str, Any]) -> str:
    """The header's value: ``key=value`` pairs of the report's known, non-empty fields."""
    return "; ".join(f"{key}={report[key]}" for key in HEADER_KEYS if report.get(key) not in (None, ""))


def kv_report(payload: bytes) -> str | None:
    """The ``X-PDServe-KV`` header value for a decode engine's JSON answer, if it reports its KV load."""
    if _REPORT_KEY not in payload:
        return None
    try:
        report = orjson.loads(payload)[wire.KV_TRANSFER_PARAMS][wire.PDSERVE_KV]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return format_report(report) if isinstance(report, dict) else None


def merge_ranks(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One request's report from every decode rank's part."""
    merged = dict(reports[0])
    merged["bytes"] = sum(int(part.get("bytes") or 0) for part in reports)
    merged["transfer_ms"] = max(float(part.get("transfer_ms") or 0.0) for part in reports)
    if recomputed := next((part for part in reports if part.get("source") == "recomputed"), None):
        merged = recomputed | {"bytes": merged["bytes"], "transfer_ms": merged["transfer_ms"]}
    if merged["source"] == "recomputed" and not merged["bytes"]:
        del merged["bytes"], merged["transfer_ms"]
    return merged


class KVReports:
    """Asks decode engines' side channels for a stream's KV report."""

    def __init__(self, timeout_s: float = REPORT_TIMEOUT_S) -> None:
        self._timeout_s = timeout_s

    async def query(self, endpoints: tuple[str, ...], kv_params: dict | None, request_id: str) -> str | None:
        """The ``X-PDServe-KV`` value for a stream whose decode engine answers on ``endpoints``, or None."""
        spec = (kv_params or {}).get(wire.PDSERVE_REPORT)
        if not endpoints or not isinstance(spec, dict) or not isinstance(message := spec.get("message"), str):
            return None
        answers = await asyncio.gather(
            *(ask(endpoint, message.encode(), self._timeout_s) for endpoint in endpoints),
            return_exceptions=True,
        )
        parts = []
        for endpoint, answer in zip(endpoints, answers, strict=True):
            try:
                part = orjson.loads(answer) if isinstance(answer, bytes) else None
            except orjson.JSONDecodeError:
                part = None
            if not isinstance(part, dict):
                logger.info("request %s: no KV report from %s (%s)", request_id, endpoint, self._why(answer))
                return None
            parts.append(part)
        return format_report(merge_ranks(parts))

    def _why(self, answer: object) -> str:
        if answer is None:
            return f"no answer in {self._timeout_s * 1000:.0f} ms"
        if isinstance(answer, BaseException):
            return f"{type(answer).__name__}: {answer}"
        return repr(answer[:40]) if isinstance(answer, bytes) else repr(answer)

    def close(self) -> None:
        """Nothing to close: each query opens and closes its own connections."""
