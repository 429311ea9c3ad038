"""The request bodies of the two-phase flow: the client's, validated, and the two the engines get.

1. ``parse_request`` validates the client's body (400/404 in OpenAI's format) and
   refuses any transfer parameters of the client's own; ``check_context_length``
   refuses a request that plainly cannot fit the model (when its length is known).
2. ``prefill_body``: the prefill leg, which asks a prefill engine to compute the
   prompt's KV and keep it: ``max_tokens=1``, ``stream=false``,
   ``kv_transfer_params.do_remote_decode``.
3. ``decode_body``: the client's original request with the ``kv_transfer_params``
   the prefill engine answered, for a decode engine, which reads the KV over its
   connector and generates.

Pure functions of dicts; the calls that carry them are ``proxy.upstream``'s.
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from contract import wire
from proxy.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound

__all__ = [
    "PREFILL_KV_PARAMS",
    "REQUEST_MODELS",
    "STATEFUL_RESPONSES",
    "ChatRequest",
    "CompletionRequest",
    "ResponsesRequest",
    "chat_messages",
    "check_context_length",
    "check_model",
    "check_request",
    "decode_body",
    "parse_object",
    "parse_request",
    "prefill_body",
]

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


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: OpenAI's Responses API, as vLLM serves it."""

    model_config = ConfigDict(extra="allow", strict=False)
    model: str = Field(min_length=1)
    stream: StrictBool | None = False
    input: str | list[dict[str, Any]] = Field(min_length=1)
    max_output_tokens: int | None = Field(default=None, ge=1)
    background: StrictBool | None = False


REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "chat": ChatRequest,
    "completion": CompletionRequest,
    "responses": ResponsesRequest,
}
STATEFUL_RESPONSES = {
    "previous_response_id": "a response is kept only by the engine that made it (vLLM stores responses in that "
    "process's memory, and by default not at all), and the next request may go to any engine: send the "
    "conversation so far in `input` instead",
    "background": "a background response is fetched later from the engine that runs it, which the proxy does "
    "not track: send the request without `background`",
}
"""What the Responses API asks of one engine's memory, refused through P/D: the field and why."""


def parse_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object (400 otherwise)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def parse_request(raw: bytes, kind: str, model_name: str, adapters: tuple[str, ...] = ()) -> dict[str, Any]:
    """Validate a request body; return it as a dict (unknown fields kept). Its model is ``model_name`` or one
    of its LoRA ``adapters``."""
    return check_request(parse_object(raw), kind, model_name, adapters)


def check_request(body: dict[str, Any], kind: str, model_name: str, adapters: tuple[str, ...] = ()) -> dict[str, Any]:
    """``parse_request`` of a body already parsed (``parse_object``)."""
    if not _plainly_valid(body, kind):
        _validate(body, kind)
    _refuse_transfer_fields(body)
    if kind == "responses":
        _refuse_stateful(body)
    check_model(body.get("model"), model_name, adapters)
    return body


def check_model(model: object, model_name: str, adapters: tuple[str, ...] = ()) -> None:
    """``ModelNotFound`` (404) unless ``model`` is the served model or one of its adapters."""
    if model != model_name and model not in adapters:
        served = ", ".join(f"`{name}`" for name in (model_name, *adapters))
        raise ModelNotFound(f"The model `{model}` does not exist; this server serves {served}", param="model")


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


TEXT_PARTS = ("text", "input_text", "output_text")
"""Content parts that are text: chat's, and the Responses API's."""


def chat_messages(body: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    """A chat or Responses API request's conversation as chat messages (``role``, ``content``), for routing: the
    Responses API's ``instructions`` first, as the system message, then its ``input`` (a string: one user
    message; items: each message item, and any other item as a message of its JSON)."""
    if kind == "chat":
        return body["messages"]
    messages = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    given = body["input"]
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    for item in given:
        if isinstance(item, dict) and "role" in item:
            messages.append({"role": item["role"], "content": item.get("content")})
        else:
            messages.append({"role": "item", "content": [item]})
    return messages


def _refuse_stateful(body: dict[str, Any]) -> None:
    for name, why in STATEFUL_RESPONSES.items():
        if body.get(name):
            raise InvalidRequest(f"{name} is not supported by pdserve's prefill/decode: {why}", param=name)


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
    if type(model) is not str or not model or kind == "responses":
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
    limit = next((n for n in ("max_completion_tokens", "max_tokens", "max_output_tokens") if body.get(n)), "max_tokens")
    completion = body.get(limit)
    completion_tokens = completion if type(completion) is int else 0
    if prompt_tokens + completion_tokens <= max_model_len:
        return
    where = next((w for w in ("messages", "input") if w in body), "prompt")
    param = where if prompt_tokens > max_model_len else limit
    requested = prompt_tokens + completion_tokens
    raise ContextLengthExceeded(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{'' if counted else 'at least '}{requested} tokens ({prompt_tokens} in the {where}, "
        f"{completion_tokens} in the completion). Please reduce the length of the {where} or completion.",
        param=param,
    )


def prefill_body(body: dict[str, Any], reader: str | None = None, kind: str = "chat") -> dict[str, Any]:
    """The prefill leg: one token, no stream; ``reader``, the decode engine that will read its KV, if known."""
    kv_params = dict(PREFILL_KV_PARAMS, **{wire.PDSERVE_READER: reader}) if reader else dict(PREFILL_KV_PARAMS)
    if kind == "responses":  # its own names; one token, not stored
        request = dict(body, max_output_tokens=1, stream=False, store=False, **{wire.KV_TRANSFER_PARAMS: kv_params})
        request.pop("stream_options", None)
        return request
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
