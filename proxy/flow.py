"""The two-phase request flow: prefill on one engine, then decode on another.

1. ``parse_request`` validates the client's body (400/404 in OpenAI's format).
2. ``prefill_body`` asks a prefill engine to compute the prompt's KV and keep
   it: ``max_tokens=1``, ``stream=false``, ``kv_transfer_params.do_remote_decode``.
3. The prefill engine answers with ``kv_transfer_params`` that say where the
   blocks are; ``decode_body`` sends the client's original request with them
   to a decode engine, which pulls the KV over its connector and generates.
4. The decode engine's answer (JSON or an SSE stream) goes back to the client.

An engine that cannot be reached, resets, times out or answers 5xx becomes
``UpstreamFailed`` (502); an engine's 4xx (e.g. a prompt longer than the
context) is the client's error and is passed through as it came.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from connectors import wire
from proxy.engine_client import EngineClient, EngineResponse
from proxy.errors import (
    ContextLengthExceeded,
    EngineConnectionError,
    InvalidRequest,
    ModelNotFound,
    UpstreamFailed,
    error_body,
)

logger = logging.getLogger(__name__)

PREFILL_KV_PARAMS = wire.PREFILL_REQUEST_PARAMS


class _Request(BaseModel):
    """The fields the proxy itself relies on; everything else passes through untouched."""

    model_config = ConfigDict(extra="allow", strict=False)
    model: str = Field(min_length=1)
    # Strict: the proxy decides between JSON and SSE on ``body["stream"]`` as sent, so only
    # true/false/null may pass (a lax "false" would be truthy here and False to vLLM).
    # Null is OpenAI's "not set", as for ``n``.
    stream: StrictBool | None = False
    max_tokens: int | None = Field(default=None, ge=1)
    n: int | None = Field(default=1, ge=1)


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]


REQUEST_MODELS: dict[str, type[_Request]] = {"chat": ChatRequest, "completion": CompletionRequest}


def parse_request(raw: bytes, kind: str, model_name: str) -> dict[str, Any]:
    """Validate a request body; return it as a dict (unknown fields kept)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    if not _plainly_valid(body, kind):
        _validate(body, kind)
    _refuse_transfer_fields(body)
    if body["model"] != model_name:
        raise ModelNotFound(
            f"The model `{body['model']}` does not exist; this server serves `{model_name}`", param="model"
        )
    return body


def _refuse_transfer_fields(body: dict[str, Any]) -> None:
    """Only what a prefill engine of the cluster issued may reach a decode engine: a client's own parameters
    would make a decode engine connect where the client says and read what it names. vLLM reads them from
    the top-level fields and from ``vllm_xargs`` (copied into the request's ``extra_args``), on every path."""
    for name in wire.CLIENT_FORBIDDEN_FIELDS:
        if name in body:
            raise InvalidRequest(
                f"{name} is set by pdserve between its engines, never by a client; remove it", param=name
            )
    xargs = body.get(wire.VLLM_XARGS)
    if xargs is None:
        return
    if not isinstance(xargs, dict):
        raise InvalidRequest(f"{wire.VLLM_XARGS} must be an object", param=wire.VLLM_XARGS)
    for name in wire.CLIENT_FORBIDDEN_FIELDS:
        if name in xargs:
            raise InvalidRequest(
                f"{wire.VLLM_XARGS}.{name} is set by pdserve between its engines, never by a client; remove it",
                param=f"{wire.VLLM_XARGS}.{name}",
            )


def _validate(body: dict[str, Any], kind: str) -> None:
    try:
        REQUEST_MODELS[kind].model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = _param(first["loc"])
        raise InvalidRequest(f"{param}: {first['msg']}", param=param) from e


def _plainly_valid(body: dict[str, Any], kind: str) -> bool:
    """True for the usual, plainly valid body, without pydantic (a few µs on every request).

    Accepts only bodies the request models accept too; anything else (wrong, or
    valid only after pydantic's lax conversions, such as ``"max_tokens": 5.0``)
    goes to pydantic, which decides and words the error.
    """
    model = body.get("model")
    if type(model) is not str or not model:
        return False
    stream = body.get("stream")
    if stream is not None and type(stream) is not bool:
        return False
    counts = ("max_tokens", "n", "max_completion_tokens") if kind == "chat" else ("max_tokens", "n")
    for name in counts:
        value = body.get(name)
        if value is not None and (type(value) is not int or value < 1):
            return False
    if kind == "chat":
        messages = body.get("messages")
        return type(messages) is list and bool(messages) and all(type(m) is dict for m in messages)
    prompt = body.get("prompt")
    if type(prompt) is str:
        return True
    if type(prompt) is not list:
        return False
    return (
        all(type(p) is str for p in prompt)
        or all(type(p) is int for p in prompt)
        or all(type(p) is list and all(type(t) is int for t in p) for p in prompt)
    )


def _param(loc: tuple[int | str, ...]) -> str | None:
    """The parameter a validation error is about: the field, then list indices (``messages.0``).

    Pydantic puts a union's member types in the location (``prompt.list[int]``);
    they name no parameter of the client's, so they and what follows are dropped.
    """
    parts = [str(loc[0])] if loc else []
    for part in loc[1:]:
        if not isinstance(part, int):
            break
        parts.append(str(part))
    return ".".join(parts) or None


def check_context_length(body: dict[str, Any], max_model_len: int) -> None:
    """``ContextLengthExceeded`` for a request that plainly cannot fit ``max_model_len`` tokens.

    The proxy has no tokenizer: it counts only token-id prompts (and a text
    prompt as at least one token), so what passes here may still be refused by
    the engine, whose 400 the client then gets as it came.
    """
    prompt = body.get("prompt")
    counted = type(prompt) is list and bool(prompt)
    if counted and type(prompt[0]) is int:
        prompt_tokens = len(prompt)
    elif counted and type(prompt[0]) is list:
        prompt_tokens = max(len(p) for p in prompt)
    else:
        counted, prompt_tokens = False, 1  # text: at least one token
    completion = body.get("max_completion_tokens") or body.get("max_tokens")
    completion_tokens = completion if type(completion) is int else 0
    if prompt_tokens + completion_tokens <= max_model_len:
        return
    where = "messages" if "messages" in body else "prompt"
    if prompt_tokens > max_model_len:
        param = where
    else:
        param = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
    requested = prompt_tokens + completion_tokens
    raise ContextLengthExceeded(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{'' if counted else 'at least '}{requested} tokens ({prompt_tokens} in the {where}, "
        f"{completion_tokens} in the completion). Please reduce the length of the {where} or completion.",
        param=param,
    )


def prefill_body(body: dict[str, Any], reader: str | None = None) -> dict[str, Any]:
    """The prefill leg: one token, no stream; ``reader``, the decode engine that will read its KV, if known."""
    kv_params = dict(PREFILL_KV_PARAMS, **{wire.PDSERVE_READER: reader}) if reader else dict(PREFILL_KV_PARAMS)
    request = dict(body, max_tokens=1, stream=False, n=1, **{wire.KV_TRANSFER_PARAMS: kv_params})
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    request.pop("stream_options", None)
    # vLLM rejects min_tokens > max_tokens; the decode engine still gets the client's min_tokens.
    request.pop("min_tokens", None)
    return request


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode leg: the client's request with the prefill engine's ``kv_transfer_params`` (none: the
    decode engine computes the prompt). A client's own field never gets here (``parse_request``)."""
    request = dict(body)
    request.pop(wire.KV_TRANSFER_PARAMS, None)
    if kv_transfer_params:
        request[wire.KV_TRANSFER_PARAMS] = kv_transfer_params
    return request


class EngineAddress(Protocol):
    """What an upstream call needs of an engine (``proxy.pool.Endpoint`` or ``EngineState``)."""

    engine_id: str
    url: str


class Upstream:
    """HTTP calls to engines, on the app's one ``EngineClient`` (keep-alive connections per engine)."""

    def __init__(self, client: EngineClient, timeout_s: float) -> None:
        self.client = client
        # A prefill call is bounded as a whole; a decode stream may run longer than
        # timeout_s in total, but never stays silent for longer than that.
        self.timeout_s = timeout_s

    async def prefill(self, endpoint: EngineAddress, path: str, body: dict, headers: dict, request_id: str) -> dict:
        """Run the prefill phase; return the engine's ``kv_transfer_params``."""
        deadline = time.monotonic() + self.timeout_s
        try:
            response = await self.client.post(endpoint.url + path, orjson.dumps(body), headers, self.timeout_s)
            payload = await response.read(max(deadline - time.monotonic(), 0.0))
        except (EngineConnectionError, TimeoutError) as e:
            raise _engine_failed(endpoint, "prefill", request_id, e) from e
        status = response.status
        if status >= 500 or status == 401:
            raise _engine_failed(endpoint, "prefill", request_id, _engine_status(status, payload))
        if status >= 400:
            raise EngineRejected(status, payload)
        try:
            return orjson.loads(payload).get(wire.KV_TRANSFER_PARAMS)
        except (orjson.JSONDecodeError, AttributeError) as e:
            raise _engine_failed(endpoint, "prefill", request_id, f"unreadable answer: {e}") from e

    async def decode(
        self, endpoint: EngineAddress, path: str, body: dict, headers: dict, request_id: str
    ) -> EngineResponse:
        """Open the decode call; return the response (the caller reads or releases it)."""
        try:
            response = await self.client.post(endpoint.url + path, orjson.dumps(body), headers, self.timeout_s)
        except (EngineConnectionError, TimeoutError) as e:
            raise _engine_failed(endpoint, "decode", request_id, e) from e
        if response.status >= 400:
            try:
                payload = await response.read(self.timeout_s)
            except (EngineConnectionError, TimeoutError) as e:
                raise _engine_failed(endpoint, "decode", request_id, e) from e
            if response.status >= 500 or response.status == 401:
                raise _engine_failed(endpoint, "decode", request_id, _engine_status(response.status, payload))
            raise EngineRejected(response.status, payload)
        return response

    async def read_all(self, response: EngineResponse, endpoint: EngineAddress, request_id: str) -> bytes:
        try:
            return await response.read(self.timeout_s)
        except (EngineConnectionError, TimeoutError) as e:
            raise _engine_failed(endpoint, "decode", request_id, e) from e

    async def stream(self, response: EngineResponse, endpoint: EngineAddress, request_id: str) -> AsyncIterator[bytes]:
        """Relay an SSE stream; an engine failing mid-stream ends it with an error event."""
        try:
            async for chunk in response.chunks(self.timeout_s):
                yield chunk
        except (EngineConnectionError, TimeoutError) as e:
            failure = _engine_failed(endpoint, "decode", request_id, e)
            yield b"data: " + orjson.dumps(failure.body()) + b"\n\n"
        finally:
            response.release()


class EngineRejected(Exception):
    """An engine answered 4xx: the client's request is at fault; relay the answer."""

    def __init__(self, status: int, payload: bytes) -> None:
        super().__init__(f"engine answered HTTP {status}")
        self.status = status
        try:
            parsed = orjson.loads(payload)
        except orjson.JSONDecodeError:
            parsed = None
        if not (isinstance(parsed, dict) and "error" in parsed):
            parsed = error_body(payload.decode(errors="replace")[:500], "invalid_request_error")
        self.body = parsed


def _engine_status(status: int, payload: bytes) -> str:
    if status == 401:  # the proxy's own key, not the client's: the client must not see a 401
        return "HTTP 401: the engine refused the proxy's engine key (is it of another cluster's secret?)"
    return f"HTTP {status}: {payload[:200]!r}"


def _engine_failed(endpoint: EngineAddress, phase: str, request_id: str, cause: object) -> UpstreamFailed:
    reason = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(cause)
    logger.warning("request %s: %s engine %s failed: %s", request_id, phase, endpoint.engine_id, reason)
    failure = UpstreamFailed(f"{phase} engine {endpoint.engine_id} failed: {reason}")
    failure.unreachable = isinstance(cause, EngineConnectionError)
    return failure
