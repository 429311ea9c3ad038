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
message; each rank answers with its part of the report as JSON or ``NONE``,
and the parts are merged by ``KVReport.merge``. No answer
within ``REPORT_TIMEOUT_S`` leaves the header out; the stream is not held up longer.
"""

from __future__ import annotations

import asyncio
import logging

import orjson

from contract import wire
from contract.kv_report import KVReport
from proxy.release import ask

__all__ = ["KVReports", "kv_report"]

logger = logging.getLogger(__name__)

REPORT_TIMEOUT_S = 0.25
_REPORT_KEY = f'"{wire.PDSERVE_KV}"'.encode()


def kv_report(payload: bytes) -> str | None:
    """The ``X-PDServe-KV`` header value for a decode engine's JSON answer, if it reports its KV load."""
    if _REPORT_KEY not in payload:
        return None
    try:
        report = KVReport.from_dict(orjson.loads(payload)[wire.KV_TRANSFER_PARAMS][wire.PDSERVE_KV])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return report.header() if report is not None else None


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
                part = KVReport.from_dict(orjson.loads(answer)) if isinstance(answer, bytes) else None
            except orjson.JSONDecodeError:
                part = None
            if part is None:
                logger.info("request %s: no KV report from %s (%s)", request_id, endpoint, self._why(answer))
                return None
            parts.append(part)
        return KVReport.merge_all(parts).header()

    def _why(self, answer: object) -> str:
        if answer is None:
            return f"no answer in {self._timeout_s * 1000:.0f} ms"
        if isinstance(answer, BaseException):
            return f"{type(answer).__name__}: {answer}"
        return repr(answer[:40]) if isinstance(answer, bytes) else repr(answer)

    def close(self) -> None:
        """Nothing to close: each query opens and closes its own connections."""
