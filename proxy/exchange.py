"""One completion request's exchange through the proxy: what both legs of the two-phase flow share.

``Front`` makes one ``Exchange`` per request (``proxy.front``) and hands it,
whole, to its model's flow, every step of it (``proxy.flow``), every engine call
(``proxy.upstream``) and the stream relay (``proxy.relay``). Its life:

1. made on arrival: the request, its API (``proxy.apis``), its id (the client's
   ``X-Request-Id`` or a new one), the reply headers (``X-Request-Id``);
2. the parsed ``body`` and the ``engine_headers`` both legs send;
3. ``routed``: the engines (``proxy.routing.Route``), which say the serving
   path (``X-PDServe-Path``, ``request.state.serving_path``); ``degrade`` when a
   leg fails and the decode engine computes the prompt. Both engines count the
   request in their ``in_flight`` from here on, so a drain (a role move, a
   scale-down) issued while the prefill leg runs waits for the decode leg too;
   each leg takes its engine's count over when it starts (``leg_starts``) and
   ends it when it ends (``EngineState.end_leg``);
4. ``kv``: the KV the prefill engine keeps for the request (``KVHandle``);
5. ``close``, once, whatever ended it (an answer, an error, the client gone,
   a stream's end): the counts of legs routed but never started are given
   back, the KV nobody read is released, the admission slot given back, the
   request counted.

``KVHandle.release`` is the proxy's one KV release (``proxy.release``): it is
idempotent and does nothing once a decode engine has the KV (``read``), so
every way an exchange ends reaches it through ``close``, and only the decode
leg's move away from a failed engine calls it earlier (that engine may have
read the KV: no other engine is sent its transfer parameters).
"""

from __future__ import annotations

import os
import time
from typing import Any

from starlette.requests import Request

from contract import headers
from proxy.apis import Api
from proxy.continuation import StreamLedger
from proxy.disconnect import cancel_on_disconnect
from proxy.limits import AdmissionGate
from proxy.metrics import DEFAULT_SERVING_PATH, ModelMetrics
from proxy.pool import EngineState
from proxy.release import KVReleaser
from proxy.routing import DEGRADED_REASONS, NO_DECODE_ENGINE, Route

__all__ = ["DECODE_ONLY", "DISAGGREGATED", "PREFILL_ONLY", "Exchange", "KVHandle"]

DISAGGREGATED, DECODE_ONLY, PREFILL_ONLY = DEFAULT_SERVING_PATH, "decode-only", "prefill-only"
"""The values of ``X-PDServe-Path`` and ``request.state.serving_path``."""


class KVHandle:
    """The KV blocks a prefill engine keeps for one request, named by the ``kv_transfer_params`` it answered.

    Two things end it: a decode engine has the blocks (``read``: its answer came),
    or the prefill engine is told that nobody will read them (``release``), so it
    frees them at once instead of at its lease's end. Whichever comes first wins;
    the other, and any repeat, does nothing.
    """

    __slots__ = ("params", "_request_id", "_releaser", "_settled")

    def __init__(self, request_id: str) -> None:
        self.params: dict[str, Any] | None = None
        """What the decode leg sends (None: none held, or released: the decode engine computes the prompt)."""
        self._request_id = request_id
        self._releaser: KVReleaser | None = None
        self._settled = False

    def hold(self, params: dict[str, Any] | None, releaser: KVReleaser) -> None:
        """The prefill engine answered ``params``: it keeps the blocks until they are read or released."""
        self.params, self._releaser = params or None, releaser

    def read(self) -> None:
        """A decode engine has the KV (its answer has begun): nothing is left to release."""
        self._settled = True

    def release(self) -> bool:
        """Tell the prefill engine to free the blocks now, unless they were read or released already;
        afterwards, either way, no decode leg sends ``params``. True if a release went out."""
        params, self.params = self.params, None
        if self._settled:
            return False
        self._settled = True
        return params is not None and self._releaser is not None and self._releaser.release(params, self._request_id)


class Exchange:
    """One completion request, from its arrival to its answer's end (see the module's docstring)."""

    __slots__ = (
        "request", "api", "request_id", "started", "reply_headers", "engine_headers", "body",
        "engines", "serving_path", "kv", "gate", "decode_failed_at", "decode_tried", "ledger", "departure",
        "_metrics", "_last_chunk", "_closed", "_prefill_routed", "_decode_routed",
    )  # fmt: skip

    def __init__(self, request: Request, api: Api, metrics: ModelMetrics) -> None:
        self.started = time.perf_counter()
        self.request, self.api = request, api
        self.request_id = request.headers.get("x-request-id") or f"pdserve-{os.urandom(16).hex()}"
        self.reply_headers = {"X-Request-Id": self.request_id}
        self.engine_headers: dict[str, str] = {}
        self.body: dict[str, Any] = {}
        self.engines: Route | None = None
        self.serving_path = DEFAULT_SERVING_PATH
        self.kv = KVHandle(self.request_id)
        self.gate: AdmissionGate | None = None
        """The admission gate whose slot the request holds, given back on ``close``."""
        self.decode_failed_at: float | None = None
        """When its first decode engine failed (``time.monotonic``; the decode leg's moves are bounded from it)."""
        self.decode_tried: list[EngineState] = []
        """The engines its decode leg was sent to, in order (more than one: it moved)."""
        self.ledger: StreamLedger | None = None
        """A continuable stream's record of what it relayed (``proxy.continuation``)."""
        self.departure: cancel_on_disconnect | None = None
        """What cancels the request when its client leaves, while it waits on its engines (``proxy.disconnect``)."""
        self._metrics = metrics
        self._last_chunk = 0.0
        self._closed = False
        self._prefill_routed: EngineState | None = None
        self._decode_routed: EngineState | None = None
        """The engines counted for a leg at routing whose leg has not started (``leg_starts``) yet."""

    def counts_for(self, metrics: ModelMetrics) -> None:
        """The request's body named its model: it counts in ``metrics`` (that model's) from now on, and has
        arrived."""
        self._metrics = metrics
        metrics.received.inc()

    def routed(self, engines: Route) -> None:
        """The router chose ``engines``: each counts the request from now on; the serving path they make, and
        the reply headers that say so."""
        self.engines = engines
        engines.decode.start_leg()
        self._decode_routed = engines.decode
        if engines.prefill is not None:
            engines.prefill.start_leg()
            self._prefill_routed = engines.prefill
        if engines.prefill is not None:
            path = DISAGGREGATED
        else:
            path = PREFILL_ONLY if engines.reason == NO_DECODE_ENGINE else DECODE_ONLY
            if engines.reason in DEGRADED_REASONS:
                self._metrics.degraded.labels(engines.reason).inc()
        self._serve_as(path, engines.reason)
        self.reply_headers[headers.DECODE] = engines.decode.engine_id

    def leg_starts(self, engine: EngineState) -> None:
        """A leg on ``engine`` starts: it takes over the count routing took there, or, on an engine routing did
        not choose (a retry's), counts now. Whatever ends the leg ends the count (``EngineState.end_leg``)."""
        if engine is self._decode_routed:
            self._decode_routed = None
        elif engine is self._prefill_routed:
            self._prefill_routed = None
        else:
            engine.start_leg()

    def _end_routed(self) -> None:
        """Give back the counts of legs routed but never started (the request ended before them)."""
        if self._prefill_routed is not None:
            self._prefill_routed.end_leg()
            self._prefill_routed = None
        if self._decode_routed is not None:
            self._decode_routed.end_leg()
            self._decode_routed = None

    def degrade(self, reason: str, path: str = DECODE_ONLY) -> None:
        """A leg failed and one engine computes the prompt itself (``decode-only; reason=...``, or
        ``prefill-only``: a prefill engine serves it alone)."""
        self._metrics.degraded.labels(reason).inc()
        self.reply_headers.pop(headers.PREFILL, None)
        self._serve_as(path, reason)

    def _serve_as(self, path: str, reason: str | None) -> None:
        self.serving_path = self.request.state.serving_path = path
        self.reply_headers[headers.PATH] = f"{path}; reason={reason}" if reason else path

    def chunk_relayed(self) -> None:
        """A stream's chunk went to the client: time to first chunk, or between chunks."""
        now = time.perf_counter()
        if self._last_chunk:
            self._metrics.inter_token_latency.observe(now - self._last_chunk)
        else:
            self._metrics.time_to_first_token.observe(now - self.started)
        self._last_chunk = now

    def close(self, status: int | None) -> None:
        """The exchange is over: release the KV if nobody read it, give the slot back and count the request
        as ``status`` (None: not counted, an error nobody expected); only the first call counts."""
        if self._closed:
            return
        self._closed = True
        self._end_routed()
        self.kv.release()
        if self.gate is not None:
            self.gate.leave()
        if status is not None:
            self._metrics.request_done(self.api.path, status, self.serving_path, time.perf_counter() - self.started)
