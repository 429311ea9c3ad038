"""The proxy's front: it reads each request once and hands it to the flow of the model it names.

For every route of ``proxy.apis.REGISTRY`` the front checks the client's key (``proxy.auth``, 401), the
Content-Type, the body's size (``proxy.limits``, 413) and the time it takes to come (408), parses it (a JSON
object, 400), picks the ``ModelFlow`` (``proxy.flow``) of the model or adapter it names (404 naming every model
served; a body that is invalid besides gets its 400 first), and has the request's API check the body (400). The
request is one ``Exchange`` from its arrival: it counts in the proxy's arrivals until its body names its model,
then in that model's metrics. A relay API's body (``/tokenize``) with no model goes to the first model's flow.
Whatever the flow raises becomes the client's error in OpenAI's format (``ProxyError``), the engine's 4xx as it
came (``EngineRejected``), or nothing for a client that left (``ClientGone``, counted).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import NoReturn

import orjson
from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from proxy.apis import Api, GenerationApi
from proxy.auth import KeyCheck, bearer_token
from proxy.bodies import check_model, parse_object
from proxy.config import ProxyConfig
from proxy.errors import ClientGone, InvalidApiKey, InvalidRequest, ProxyError, error_response
from proxy.exchange import Exchange
from proxy.flow import ModelFlow
from proxy.limits import read_body
from proxy.metrics import ModelMetrics
from proxy.relay import RelayResponse
from proxy.upstream import EngineRejected

__all__ = ["Front"]


class Front:
    """Reads each request and hands it to its model's flow (see the module's docstring)."""

    def __init__(self, config: ProxyConfig, flows: Sequence[ModelFlow], api_keys: KeyCheck, arrivals: ModelMetrics):
        """``config``: the proxy's settings (the first model's); ``arrivals``: what a request counts in until its
        body names its model."""
        self.config, self.api_keys, self.arrivals = config, api_keys, arrivals
        self.flows = {name: flow for flow in flows for name in flow.names}
        self.first = flows[0]
        self._served = tuple(self.flows)

    def require_api_key(self, request: Request) -> None:
        if self.api_keys.keys and not self.api_keys.allows(bearer_token(request.headers.get("authorization"))):
            raise InvalidApiKey("Incorrect or missing API key: send it as 'Authorization: Bearer <key>'")

    async def serve(self, request: Request, api: Api) -> Response:
        """The answer to one request of ``api``; the exchange closes here, or when its stream ends."""
        exchange = Exchange(request, api, self.arrivals)
        response: Response | None = None
        try:
            response = await self._respond(exchange, self._relay if api.relay else self._generate)
            return response
        finally:
            if not isinstance(response, RelayResponse):  # a stream closes its exchange when it ends
                exchange.close(response.status_code if response is not None else None)

    async def _respond(self, exchange: Exchange, answer: Callable[[Exchange], Awaitable[Response]]) -> Response:
        """``answer``'s response, or the error it became."""
        try:
            return await answer(exchange)
        except ProxyError as e:
            e.headers = exchange.reply_headers | e.headers
            return error_response(e)
        except EngineRejected as e:
            headers = exchange.reply_headers
            return Response(orjson.dumps(e.body), status_code=e.status, media_type="application/json", headers=headers)
        except ClientGone as e:
            return Response(status_code=e.status)  # sent to nobody; counted

    async def _generate(self, exchange: Exchange) -> Response:
        api = exchange.api
        assert isinstance(api, GenerationApi)
        body = parse_object(await self._body(exchange))
        model = body.get("model")
        flow = self.flows.get(model) if isinstance(model, str) else None
        if flow is None:
            self._unserved(model, lambda names: api.check(body, names[0], names[1:]))
        exchange.counts_for(flow.metrics)
        exchange.body = api.check(body, flow.config.model_name, flow.config.adapters)
        return await flow.generate(exchange)

    async def _relay(self, exchange: Exchange) -> Response:
        raw = await self._body(exchange)
        model = parse_object(raw).get("model")
        flow = self.first if model is None else self.flows.get(model) if isinstance(model, str) else None
        if flow is None:
            self._unserved(model)
        exchange.counts_for(flow.metrics)
        return await flow.relay(exchange, raw)

    def _unserved(self, model: object, check: Callable[[tuple[str, ...]], object] | None = None) -> NoReturn:
        """A request for a model nobody serves: ``check``'s error first (a body invalid besides gets its 400), else
        the 404 naming every model served."""
        if check is not None:
            check(self._served)
        check_model(model, self._served[0], self._served[1:])
        raise AssertionError(f"model {model!r} is served and not")

    async def _body(self, exchange: Exchange) -> bytes:
        """The client's body, once its key and Content-Type are checked, within the size and time limits."""
        request = exchange.request
        self.require_api_key(request)
        if "json" not in request.headers.get("content-type", "application/json"):
            raise InvalidRequest("Content-Type must be application/json")
        config = self.config
        try:
            return await read_body(request, config.max_body_bytes, config.body_timeout_s, config.body_idle_timeout_s)
        except ClientDisconnect as e:
            raise ClientGone(f"request {exchange.request_id}: the client went away while sending its body") from e
