"""``POST /v1/responses``: OpenAI's Responses API, as vLLM serves it.

What asks for one engine's memory is refused (``STATEFUL``): ``previous_response_id`` and ``background``. Its
streams are not continued on another engine, and a shared KV tier is not asked about its prompt (the engine's
lookup takes chat and completion bodies)."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from contract import wire
from proxy.apis.base import GenerationApi, prefill_params
from proxy.apis.messages import messages_prefix, messages_tokens
from proxy.errors import InvalidRequest, UpstreamFailed

__all__ = ["STATEFUL", "Responses", "ResponsesRequest", "conversation"]


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=False)
    model: str = Field(min_length=1)
    stream: StrictBool | None = False
    input: str | list[dict[str, Any]] = Field(min_length=1)
    max_output_tokens: int | None = Field(default=None, ge=1)
    background: StrictBool | None = False


STATEFUL = {
    "previous_response_id": "a response is kept only by the engine that made it (vLLM stores responses in that "
    "process's memory, and by default not at all), and the next request may go to any engine: send the "
    "conversation so far in `input` instead",
    "background": "a background response is fetched later from the engine that runs it, which the proxy does "
    "not track: send the request without `background`",
}
"""What the Responses API asks of one engine's memory, refused through P/D: the field and why."""

_PREAMBLE = (b"response.created", b"response.in_progress")


class Responses(GenerationApi):
    name = "responses"
    path = wire.RESPONSES_PATH
    request_model = ResponsesRequest
    prompt_field = "input"
    limit_fields = ("max_output_tokens",)
    tier_lookup = False

    def refuse(self, body: dict[str, Any]) -> None:
        for name, why in STATEFUL.items():
            if body.get(name):
                raise InvalidRequest(f"{name} is not supported by pdserve's prefill/decode: {why}", param=name)

    def prefix_text(self, body: dict[str, Any], limit: int) -> str:
        return messages_prefix(conversation(body), limit)

    def estimate_tokens(self, body: dict[str, Any]) -> int:
        return messages_tokens(conversation(body))

    def prefill_body(self, body: dict[str, Any], reader: str | None = None) -> dict[str, Any]:
        """One output token, no stream, not stored."""
        params = prefill_params(reader)
        request = dict(body, max_output_tokens=1, stream=False, store=False, **{wire.KV_TRANSFER_PARAMS: params})
        request.pop("stream_options", None)
        return request

    def continuation_refusal(self, body: dict[str, Any]) -> str | None:
        return "a Responses API stream is not continued"

    def generated(self, chunk: bytes) -> bool:
        """An event past the preamble vLLM sends before the engine has run (``response.created``,
        ``response.in_progress``)."""
        return any(line.startswith(b"event: ") and line[7:].strip() not in _PREAMBLE for line in chunk.split(b"\n"))

    def error_event(self, failure: UpstreamFailed) -> bytes:
        """The Responses API's ``error`` event."""
        error = failure.body()["error"]
        event = {"type": "error", "code": error.get("code"), "message": error["message"], "param": None}
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"


def conversation(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request as chat messages (``role``, ``content``), for routing: ``instructions`` first, as the system
    message, then its ``input`` (a string: one user message; items: each message item, and any other item as a
    message of its JSON)."""
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
