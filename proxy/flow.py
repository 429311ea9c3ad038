"""One model's flow: admission, routing, the prefill leg (tried again on another engine if it fails), the
decode leg, and the answer or the relayed stream; and the relays one engine answers (``/tokenize``).

``proxy.front.Front`` reads each request and hands it, as an ``Exchange`` (``proxy.exchange``) whose body its
API (``proxy.apis``) has checked, to the ``ModelFlow`` of the model it names; ``proxy.app.create_app`` builds one
flow per model, open: with the engine calls' ``Upstream``, the ``KVReleaser`` and the ``KVReports``, until its
``close`` (the app's lifespan). The exchange carries what both legs need, the prefill's KV (``KVHandle``) and, at
its ``close``, the request's end: the KV nobody read released, the admission slot given back, the request
counted. The front closes it, or the ``RelayResponse`` of a stream when the stream ends (``proxy.relay``). Every
leg counts in its engine's ``in_flight`` from the moment the router chose the engine (so a drain waits for a
decode leg whose prefill still runs) until the leg ends, whatever ends it; a retry's engine counts from the
retry on.

Every request waits for a slot of its model's ``AdmissionGate`` (``proxy.limits``):
``max_concurrent_requests`` when set, else one that follows the pools' ready engines (``pool_limit``; the flow
watches the pool until ``close``).

Engines are called with the cluster's engine key (``config.engine_auth``; ``contract.auth``), or with the client's
own ``Authorization`` only for engines someone else started with ``--api-key`` (``forward_authorization``). The
prefill engine is told which decode engine will read its KV (``config.bind_reader``): it binds the transfer
parameters it issues to that engine, so no other can use them. Whether bound or not, the parameters one decode
engine was sent never go to another: a decode leg that moves after its engine failed has the prefill's KV
released and the next engine computes the prompt (``_moved_decode``). A client that leaves during the prefill leg
of an engine whose KV can be released (its side channel known: the ``pdserve`` connector) lets that leg answer,
and its KV is released at once (``_prefill_call``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import orjson
from fastapi.responses import Response

from contract import headers, wire
from proxy.auth import load_engine_key
from proxy.bodies import decode_body
from proxy.config import ProxyConfig
from proxy.continuation import StreamLedger
from proxy.disconnect import cancel_on_disconnect
from proxy.engine_client import EngineResponse
from proxy.errors import ClientGone, UpstreamFailed
from proxy.exchange import DECODE_ONLY, PREFILL_ONLY, Exchange
from proxy.health import HealthTracker
from proxy.kv_report import KVReports, kv_report
from proxy.limits import DEFAULT_REQUESTS_PER_ENGINE, AdmissionGate, pool_limit
from proxy.metrics import ModelMetrics
from proxy.pool import EngineState
from proxy.relay import DecodeStream, Moved, Mover, RelayResponse
from proxy.release import KVReleaser
from proxy.routing import DECODE_FAILED, PREFILL_FAILED, Route, Router
from proxy.upstream import EngineRejected, Upstream

__all__ = ["ModelFlow"]

logger = logging.getLogger(__name__)


class ModelFlow:
    """Serves one model's requests (and its adapters') through its pools (see the module's docstring)."""

    def __init__(
        self,
        config: ProxyConfig,
        router: Router,
        tracker: HealthTracker,
        metrics: ModelMetrics,
        checks_health: bool,
        upstream: Upstream,
    ) -> None:
        self.config, self.router, self.tracker, self.metrics = config, router, tracker, metrics
        self.names = (config.model_name, *config.adapters)
        """What a request may send as its model to come here."""
        self.checks_health = checks_health
        self.upstream = upstream
        self.releaser = KVReleaser()
        self.kv_reports = KVReports()
        self.retries = config.prefill_retries
        self.requests_per_engine = config.requests_per_engine or DEFAULT_REQUESTS_PER_ENGINE
        self.follows_pool = config.max_concurrent_requests is None  # else the user's limit stays
        self.gate = AdmissionGate(
            config.max_concurrent_requests or pool_limit(router.pool, self.requests_per_engine),
            config.max_queued_requests,
        )
        self.engine_authorization = f"Bearer {load_engine_key()}" if config.engine_auth else None
        if self.follows_pool:
            router.pool.watch(self.fit_gate)

    def fit_gate(self) -> None:
        """Size the admission gate to the pools' ready engines (``pool_limit``)."""
        limit = pool_limit(self.router.pool, self.requests_per_engine)
        if limit != self.gate.max_running:
            logger.info("admission: at most %d requests at once (%d per ready engine)", limit, self.requests_per_engine)
            self.gate.resize(limit)

    async def close(self) -> None:
        if self.follows_pool:
            self.router.pool.unwatch(self.fit_gate)
        await self.releaser.close()
        self.kv_reports.close()

    def engine_key_headers(self) -> dict[str, str]:
        """What an engine call of the proxy's own (not a client's request) sends: the cluster's engine key."""
        return {"Authorization": self.engine_authorization} if self.engine_authorization is not None else {}

    def engine_headers(self, exchange: Exchange) -> dict[str, str]:
        """The headers of both legs' engine calls."""
        # identity: answers are relayed byte for byte, so they must not come compressed.
        headers = {
            "Content-Type": "application/json", "X-Request-Id": exchange.request_id, "Accept-Encoding": "identity"
        }  # fmt: skip
        if self.engine_authorization is not None:
            headers["Authorization"] = self.engine_authorization  # the cluster's engines take only this
        elif self.config.forward_authorization and (authorization := exchange.request.headers.get("authorization")):
            headers["Authorization"] = authorization  # engines started with --api-key check it
        return headers

    # ---------------------------------------------------------------- a request

    async def relay(self, exchange: Exchange, raw: bytes) -> Response:
        """A request no KV moves for (a relay API: ``/tokenize``, ``/detokenize``): the client's body to one ready
        engine of either pool once it has a slot of the admission gate; its answer as it came. Its call counts in
        the engine's ``in_flight``, so a drain waits for it."""
        exchange.engine_headers = self.engine_headers(exchange)
        async with cancel_on_disconnect(exchange.request, exchange.request_id):
            if not self.gate.admit():
                await self.gate.enter()
            exchange.gate = self.gate  # given back when the exchange closes
            engine = self.router.any_engine()
            exchange.reply_headers[headers.DECODE if engine.role == "decode" else headers.PREFILL] = engine.engine_id
            exchange.leg_starts(engine)
            try:
                status, payload = await self.upstream.call(engine, exchange, raw)
            finally:
                engine.end_leg()
        return Response(payload, status_code=status, media_type="application/json", headers=exchange.reply_headers)

    async def generate(self, exchange: Exchange) -> Response:
        """A request of this flow's model, its body checked by its API: the context length, a slot, both legs."""
        request = exchange.request
        if self.config.max_model_len is not None:
            exchange.api.check_length(exchange.body, self.config.max_model_len)
        async with cancel_on_disconnect(request, exchange.request_id) as departure:
            exchange.departure = departure
            if not self.gate.admit():  # a slot at once, or wait in the queue (no coroutine when there is room)
                await self.gate.enter()
            exchange.gate = self.gate  # given back when the exchange closes
            answer = await self._two_legs(exchange)
            if isinstance(answer, DecodeStream):
                return await self._relay(exchange, answer)
        return answer

    async def _two_legs(self, exchange: Exchange) -> Response | DecodeStream:
        """Route, prefill, decode: the JSON answer, or the stream to relay."""
        exchange.engine_headers = self.engine_headers(exchange)
        engines = await self._route(exchange)
        stream = bool(exchange.body.get("stream"))
        if stream and (why := self._not_continued(exchange)) is None:
            exchange.ledger = StreamLedger(exchange.body, exchange.api)
        prefill_started = time.perf_counter()
        if engines.prefill is not None:
            await self._prefill_or_degrade(exchange, engines)
        decode_started = time.perf_counter()
        response, engine = await self._open_decode(exchange, engines)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "request %s: queued %.1f ms, prefill %.1f ms, decode headers %.1f ms",
                exchange.request_id, 1000 * (prefill_started - exchange.started),
                1000 * (decode_started - prefill_started), 1000 * (time.perf_counter() - decode_started),
            )  # fmt: skip
        if stream:
            chunks, ledger = self.upstream.stream(response, engine, exchange), exchange.ledger
            rewrite, mover = ledger.relay if ledger else None, self._stream_mover(exchange, engines, why)
            return DecodeStream(chunks, response, engine, exchange, rewrite, mover)
        payload, engine = await self._read_answer(exchange, engines, response, engine)
        engine.failures = 0
        exchange.kv.read()
        if report := kv_report(payload):
            exchange.reply_headers[headers.KV] = report
        return Response(payload, media_type="application/json", headers=exchange.reply_headers)

    async def _read_answer(
        self, exchange: Exchange, engines: Route, response: EngineResponse, engine: EngineState
    ) -> tuple[bytes, EngineState]:
        """The decode engine's whole JSON answer, and the engine that gave it; an engine whose connection
        breaks before its answer is all read hands the request on as one that breaks before it answers
        (``_moved_decode``)."""
        tried = exchange.decode_tried
        while True:
            try:
                payload = await self.upstream.read_all(response, engine, exchange)
            except UpstreamFailed as failure:
                engine.end_leg()
                self._unreachable(engine, failure, exchange.request_id)
                retry = self._moved_decode(exchange, engines, tried, failure)
                if retry is None:
                    raise
                response, engine = await self._open_decode(exchange, Route(None, retry, engines.prefix))
                continue
            engine.end_leg()
            return payload, engine

    def _moved_decode(
        self, exchange: Exchange, engines: Route, tried: list[EngineState], failure: UpstreamFailed
    ) -> EngineState | None:
        """The engine the decode leg moves to after ``tried[-1]`` failed, or None (the failure stands).

        It moves when the engine could not be reached, or its connection broke before a non-streamed answer came
        (it died under the request, kill -9 or a lost host: nothing has reached the client), ``decode_retries``
        times at most, within ``decode_retry_s`` of the first failure: to another ready decode engine or, with
        ``degrade`` and none left, a prefill engine, which serves it alone. The prefill's KV is released and the
        next engine computes the prompt itself (``decode-only`` or ``prefill-only``, ``reason=decode-failed``),
        which gives a greedy or seeded request the same tokens, whatever ``bind_reader`` says: the failed engine
        may have read the KV before it died, and then the prefill engine has freed those blocks (vLLM's
        NixlConnector holds no lease), so no other engine ever gets the transfer parameters one engine was sent.
        A timeout or a 5xx does not move it: the engine may still be working."""
        config = self.config
        if exchange.decode_failed_at is None:
            exchange.decode_failed_at = time.monotonic()
        movable = (
            failure.unreachable
            and len(tried) <= config.decode_retries
            and time.monotonic() - exchange.decode_failed_at < config.decode_retry_s
        )
        retry = self.router.retry("decode", engines.prefix, tried) if movable else None
        if retry is None and movable and config.degrade:
            retry = self.router.retry("prefill", engines.prefix, tried)
        if retry is None:
            if movable or len(tried) > 1:  # it moved before, or would have, had there been an engine to go to
                self.metrics.migrations.labels("failed").inc()
            return None
        logger.warning(
            "request %s: decode engine %s failed; moving it to %s engine %s",
            exchange.request_id, tried[-1].engine_id, retry.role, retry.engine_id,
        )  # fmt: skip
        exchange.reply_headers[headers.MIGRATED] = ", ".join(e.engine_id for e in tried)
        if exchange.kv.params:
            exchange.kv.release()  # sent to the engine that failed, which may have read it: nobody else reads it
            exchange.degrade(DECODE_FAILED, PREFILL_ONLY if retry.role == "prefill" else DECODE_ONLY)
        elif retry.role == "prefill":
            exchange.degrade(DECODE_FAILED, PREFILL_ONLY)
        tried.append(retry)
        return retry

    async def _route(self, exchange: Exchange) -> Route:
        """The request's engines, asking a tier engine first what the shared KV tier holds of the prompt when
        routing reads it (no answer within ``tier_lookup_timeout_s``: routed as without a tier)."""
        held = None
        engine = self.router.tier_engine() if self.router.asks_tier(exchange.body, exchange.api) else None
        if engine is not None:
            held = await self.upstream.tier_held(engine, exchange)
            self.metrics.tier_lookups.labels("failed" if held is None else "ok").inc()
        engines = self.router.route(exchange.body, exchange.api, held)
        exchange.routed(engines)
        return engines

    async def _prefill_or_degrade(self, exchange: Exchange, engines: Route) -> None:
        """The prefill leg; if it fails on every engine tried, the decode engine computes the prompt (``degrade``)."""
        assert engines.prefill is not None
        try:
            kv_params = await self._prefill(exchange, engines)
        except UpstreamFailed as failure:
            if not self.config.degrade:
                raise
            # Nothing reached the client yet: the decode engine computes the prompt (and says so).
            logger.warning(
                "request %s: the prefill leg failed (%s); decode engine %s computes the prompt",
                exchange.request_id, failure.message, engines.decode.engine_id,
            )  # fmt: skip
            exchange.degrade(PREFILL_FAILED)
            return
        exchange.kv.hold(kv_params, self.releaser)
        if not kv_params:
            logger.warning(
                "request %s: prefill engine %s returned no kv_transfer_params; decode engine %s "
                "will compute the prompt itself",
                exchange.request_id, exchange.reply_headers[headers.PREFILL], engines.decode.engine_id,
            )  # fmt: skip

    async def _prefill(self, exchange: Exchange, engines: Route) -> dict | None:
        """The prefill leg, tried again on other engines if it fails (nothing has reached the client yet)."""
        assert engines.prefill is not None
        reader = engines.decode.engine_id if self.config.bind_reader else None
        body = exchange.api.prefill_body(exchange.body, reader)
        engine: EngineState = engines.prefill
        tried: list[EngineState] = []
        while True:
            exchange.reply_headers[headers.PREFILL] = engine.engine_id
            exchange.leg_starts(engine)  # counted since routing (a retry's engine: from now)
            try:
                kv_params = await self._prefill_call(engine, exchange, body)
            except UpstreamFailed as e:
                failure = e
            else:
                engine.failures = 0
                return kv_params
            finally:
                engine.end_leg()
            self._unreachable(engine, failure, exchange.request_id)
            tried.append(engine)
            retry = self.router.retry("prefill", engines.prefix, tried) if len(tried) <= self.retries else None
            if retry is None:
                raise failure
            logger.warning(
                "request %s: prefill engine %s failed; trying prefill engine %s",
                exchange.request_id, engine.engine_id, retry.engine_id,
            )  # fmt: skip
            engine = retry

    async def _prefill_call(self, engine: EngineState, exchange: Exchange, body: dict) -> dict | None:
        """One prefill call's ``kv_transfer_params``.

        A client that leaves during the call to an engine whose KV can be released (``kv_endpoints``: the
        ``pdserve`` connector) does not cut it: its answer may be on its way already (the engine has finished,
        so an abort would free nothing and the blocks would wait out their lease). The call goes on to its
        answer, whose KV the exchange then holds and, as the request ends (``ClientGone``), releases at once;
        the request keeps its slot and its engine's count until the engine is done with it. Other engines' calls
        are cancelled with the request (``proxy.disconnect``): vLLM aborts a prefill not yet done, and their KV
        has no release message."""
        departure = exchange.departure
        if not engine.kv_endpoints or departure is None:
            return await self.upstream.prefill(engine, exchange, body)
        departure.defer()
        try:
            kv_params = await self.upstream.prefill(engine, exchange, body)
        except Exception as e:
            if departure.resume():
                raise ClientGone(f"request {exchange.request_id}: the client went away") from e
            raise
        except BaseException:
            departure.resume()
            raise
        if departure.resume():
            exchange.kv.hold(kv_params, self.releaser)  # released as the exchange closes, now
            raise ClientGone(f"request {exchange.request_id}: the client went away during the prefill leg")
        return kv_params

    async def _open_decode(
        self, exchange: Exchange, engines: Route, leg: Callable[[], tuple[str, dict]] | None = None
    ) -> tuple[EngineResponse, EngineState]:
        """Open the decode leg: the response and its engine (its leg started). An engine that fails before it
        answers hands the request on (``_moved_decode``; ``exchange.decode_tried``: the engines it was on).
        ``leg``: the route and body of each try (default: the client's route, ``decode_body``)."""
        engine = engines.decode
        tried = exchange.decode_tried
        if not tried:
            tried.append(engine)
        while True:
            exchange.reply_headers[headers.DECODE] = engine.engine_id
            exchange.leg_starts(engine)  # counted since routing, through the prefill leg (a retry's: from now)
            route, body = leg() if leg is not None else (exchange.api.path, self._decode_body(exchange))
            try:
                response = await self.upstream.decode(engine, exchange, body, route)
                if len(tried) > 1:
                    self.metrics.migrations.labels("served").inc()
                return response, engine
            except BaseException as e:
                engine.end_leg()
                if not isinstance(e, UpstreamFailed):
                    raise
                failure = e
            self._unreachable(engine, failure, exchange.request_id)
            retry = self._moved_decode(exchange, engines, tried, failure)
            if retry is None:
                raise failure
            engine = retry

    @staticmethod
    def _decode_body(exchange: Exchange) -> dict:
        body = decode_body(exchange.body, exchange.kv.params)
        return StreamLedger.decode_request(body) if exchange.ledger is not None else body

    # ---------------------------------------------------------------- a stream whose engine fails

    def _not_continued(self, exchange: Exchange) -> str | None:
        """Why a stream of this exchange would not be continued on another engine; None if it would."""
        if not self.config.decode_retries:
            return "proxy.decode_retries is 0"
        return exchange.api.continuation_refusal(exchange.body)

    def _stream_mover(self, exchange: Exchange, engines: Route, why: str | None) -> Mover:
        """How the exchange's stream goes on when its decode engine fails (``DecodeStream``; ``why``: the reason
        it cannot be continued, None if it can).

        Nothing relayed yet: the request moves as a non-streamed one does (``_moved_decode``) and starts again.
        Tokens relayed: a continuable stream goes on, on the engine ``_moved_decode`` picks, as the completion of
        the prompt's and the sent tokens' ids (``proxy.continuation``), after an SSE comment that says so; one
        whose last token went out gets only its end. Otherwise, or with no engine to go to, it ends with the
        error event, which says why it was not continued."""

        async def move(failure: UpstreamFailed, relayed: bool) -> Moved | bytes:
            ledger, tried = exchange.ledger, exchange.decode_tried
            failed = tried[-1]
            self._unreachable(failed, failure, exchange.request_id)
            reason = why if why is not None or not relayed or ledger is None else ledger.continuable()
            if relayed and reason is not None:
                logger.warning("request %s: its stream is not continued: %s", exchange.request_id, reason)
                failure.message += f"; the stream could not be continued: {reason}"
                return exchange.api.error_event(failure)
            if relayed and ledger is not None and ledger.finished:
                return ledger.ending()
            retry = self._moved_decode(exchange, engines, tried, failure)
            if retry is None:
                return exchange.api.error_event(failure)
            leg, rewrite, note = None, ledger.relay if ledger else None, b""
            if ledger is not None:
                ledger.drop_partial()
            if relayed:
                assert ledger is not None
                leg, rewrite = (lambda: (wire.COMPLETIONS_PATH, ledger.continuation_body())), ledger.continued
                note = (
                    f": pdserve: decode engine {failed.engine_id} failed after {len(ledger.sent)} tokens; "
                    f"continued on {retry.role} engine {retry.engine_id}\n\n"
                ).encode()
            elif ledger is not None:
                ledger.restart()
            try:
                response, engine = await self._open_decode(exchange, Route(None, retry, engines.prefix), leg)
            except UpstreamFailed as again:
                return exchange.api.error_event(again)
            except EngineRejected as rejected:  # the continuation refused (a 4xx): the stream ends with it
                self.metrics.migrations.labels("failed").inc()
                return b"data: " + orjson.dumps(rejected.body) + b"\n\n"
            return Moved(self.upstream.stream(response, engine, exchange), response, engine, rewrite, note)

        return move

    def _unreachable(self, engine: EngineState, failure: UpstreamFailed, request_id: str) -> None:
        if self.checks_health and failure.unreachable:
            self.tracker.failed(engine, failure.message, request_id)

    async def _relay(self, exchange: Exchange, stream: DecodeStream) -> Response:
        """The streamed answer. When the decode engine can say how the KV got to it (``pdserve`` connector),
        its headers wait for the first chunk (the KV is loaded by then) and carry ``X-PDServe-KV``."""
        engine, kv_params = stream.engine, exchange.kv.params
        if engine.kv_endpoints and kv_params and wire.PDSERVE_REPORT in kv_params:
            try:
                if await stream.first() is not None:
                    asked = time.perf_counter()
                    if report := await self.kv_reports.query(engine.kv_endpoints, kv_params, exchange.request_id):
                        exchange.reply_headers[headers.KV] = report
                    if logger.isEnabledFor(logging.DEBUG):
                        logger.debug(
                            "request %s: KV report from decode engine %s in %.2f ms",
                            exchange.request_id, engine.engine_id, 1000 * (time.perf_counter() - asked),
                        )  # fmt: skip
            except BaseException:  # the client went away: no response will close the stream
                await stream.aclose()
                raise
        return RelayResponse(stream, exchange, self.config.stream_write_timeout_s)
