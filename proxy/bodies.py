"""The request bodies of the two-phase flow, whatever their API: the client's, checked, and the decode leg's.

1. ``parse_object`` reads the client's body (a JSON object, else 400); its API checks it
   (``proxy.apis``: ``GenerationApi.check``), with ``check_model`` (404 for a model
   nobody serves) and ``refuse_transfer_fields`` (a client's own transfer parameters).
2. The prefill leg's body is its API's (``GenerationApi.prefill_body``): compute the
   prompt's KV and keep it.
3. ``decode_body``: the client's original request with the ``kv_transfer_params``
   the prefill engine answered, for a decode engine, which reads the KV over its
   connector and generates.

Pure functions of dicts; the calls that carry them are ``proxy.upstream``'s.
"""

from __future__ import annotations

from typing import Any

import orjson

from contract import wire
from proxy.errors import InvalidRequest, ModelNotFound

__all__ = ["check_model", "decode_body", "parse_object", "refuse_transfer_fields"]


def parse_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object (400 otherwise)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def check_model(model: object, model_name: str, adapters: tuple[str, ...] = ()) -> None:
    """``ModelNotFound`` (404) unless ``model`` is the served model or one of its adapters."""
    if model != model_name and model not in adapters:
        served = ", ".join(f"`{name}`" for name in (model_name, *adapters))
        raise ModelNotFound(f"The model `{model}` does not exist; this server serves {served}", param="model")


def refuse_transfer_fields(body: dict[str, Any]) -> None:
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


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode leg: the client's request with the prefill engine's ``kv_transfer_params`` (none: the
    decode engine computes the prompt). A client's own field never gets here (``refuse_transfer_fields``)."""
    request = dict(body)
    request.pop(wire.KV_TRANSFER_PARAMS, None)
    if kv_transfer_params:
        request[wire.KV_TRANSFER_PARAMS] = kv_transfer_params
    return request
