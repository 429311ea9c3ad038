"""What every OpenAI API the proxy serves has in common, and what each of its modules defines.

A ``GenerationApi`` is served through prefill and decode (``proxy.flow``): its module gives its path, its
request model and the fields it refuses, the prompt as routing reads it (``prefix_text``, ``estimate_tokens``)
and whether a shared KV tier can be asked about it (``tier_lookup``), the prefill leg's body, whether and how a
stream of it is continued on another engine (``continuation_refusal``, ``continued_choice``), and its stream
events (``generated``, ``error_event``). A ``RelayApi`` (``/tokenize``, ``/detokenize``) is one engine's answer
as it came, no KV moved.

The instances are stateless; ``proxy.apis.REGISTRY`` lists them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from contract import wire
from proxy.bodies import check_model, refuse_transfer_fields
from proxy.continuation import refusal
from proxy.errors import ContextLengthExceeded, InvalidRequest, UpstreamFailed

__all__ = ["CHARS_PER_TOKEN", "Api", "GenerationApi", "OpenAIRequest", "RelayApi"]

CHARS_PER_TOKEN = 4
"""The token estimate without a tokenizer: about 4 characters a token for English text with BPE vocabularies."""


class OpenAIRequest(BaseModel):
    """The fields the proxy itself relies on in a chat or completion request; everything else passes through."""

    model_config = ConfigDict(extra="allow", strict=False)
    model: str = Field(min_length=1)
    # Strict: the proxy decides between JSON and SSE on ``body["stream"]`` as sent, so only
    # true/false/null may pass (a lax "false" would be truthy here and False to vLLM).
    # Null is OpenAI's "not set", as for ``n``.
    stream: StrictBool | None = False
    max_tokens: int | None = Field(default=None, ge=1)
    n: int | None = Field(default=1, ge=1)


class Api:
    """An OpenAI route the proxy serves: its ``path`` (the engines' too) and its name (the route's)."""

    name: ClassVar[str]
    path: ClassVar[str]
    relay: ClassVar[bool]
    """True: one engine answers it as it came (``ModelFlow.relay``); False: prefill and decode serve it."""


class RelayApi(Api):
    """A route no KV moves for: the client's body, checked as any (key, size, JSON, model), to one ready engine of
    either pool; its answer as it came."""

    relay = True


class GenerationApi(Api, ABC):
    """An API served through prefill and decode (see the module's docstring); its module overrides what differs."""

    relay = False
    request_model: ClassVar[type[BaseModel]]
    prompt_field: ClassVar[str]
    """Where the prompt is (named in a context-length error)."""
    limit_fields: ClassVar[tuple[str, ...]]
    """The fields that limit the tokens generated, the one that wins first."""
    tier_lookup: ClassVar[bool] = True
    """Whether a shared KV tier's engine can say how much of its prompt it holds (``wire.TIER_HELD_PATH``: it
    takes a body with ``messages`` or ``prompt``)."""

    # ---------------------------------------------------------------- the client's body

    def check(self, body: dict[str, Any], model_name: str, adapters: tuple[str, ...] = ()) -> dict[str, Any]:
        """The body (a JSON object), validated (400 ``InvalidRequest``, 404 ``ModelNotFound``): its model is
        ``model_name`` or one of its LoRA ``adapters``; unknown fields are kept."""
        if not self.plainly_valid(body):
            self.validate(body)
        refuse_transfer_fields(body)
        self.refuse(body)
        check_model(body.get("model"), model_name, adapters)
        return body

    def plainly_valid(self, body: dict[str, Any]) -> bool:
        """True for the usual, plainly valid body, without pydantic (a few µs on every request). Accepts only
        bodies ``request_model`` accepts too; anything else goes to ``validate``, which decides and words the
        error."""
        return False

    def validate(self, body: dict[str, Any]) -> None:
        try:
            self.request_model.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            param = _param(first["loc"])
            raise InvalidRequest(f"{param}: {first['msg']}", param=param) from e

    def refuse(self, body: dict[str, Any]) -> None:
        """``InvalidRequest`` for a field this API has that P/D cannot serve."""

    def check_length(self, body: dict[str, Any], max_model_len: int) -> None:
        """``ContextLengthExceeded`` for a request that plainly cannot fit ``max_model_len`` tokens.

        The proxy has no tokenizer: it counts only token-id prompts (and a text prompt as at least one token),
        so what passes here may still be refused by the engine, whose 400 the client then gets as it came."""
        prompt = body.get("prompt")
        counted = type(prompt) is list and bool(prompt)
        if counted and type(prompt[0]) is int:
            prompt_tokens = len(prompt)
        elif counted and type(prompt[0]) is list:
            prompt_tokens = max(len(p) for p in prompt)
        else:
            counted, prompt_tokens = False, 1  # text: at least one token
        limit = next((n for n in self.limit_fields if body.get(n)), self.limit_fields[-1])
        completion = body.get(limit)
        completion_tokens = completion if type(completion) is int else 0
        if prompt_tokens + completion_tokens <= max_model_len:
            return
        where = self.prompt_field
        param = where if prompt_tokens > max_model_len else limit
        requested = prompt_tokens + completion_tokens
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{'' if counted else 'at least '}{requested} tokens ({prompt_tokens} in the {where}, "
            f"{completion_tokens} in the completion). Please reduce the length of the {where} or completion.",
            param=param,
        )

    # ---------------------------------------------------------------- the prompt, for routing

    @abstractmethod
    def prefix_text(self, body: dict[str, Any], limit: int) -> str | list[int]:
        """The prompt's first ``limit`` characters (or token ids), as ``proxy.routing.prefix_hashes`` cuts it
        into blocks: only equality of prefixes matters."""

    @abstractmethod
    def estimate_tokens(self, body: dict[str, Any]) -> int:
        """The prompt's length in tokens, without a tokenizer (``CHARS_PER_TOKEN``)."""

    # ---------------------------------------------------------------- the prefill leg

    def prefill_body(self, body: dict[str, Any], reader: str | None = None) -> dict[str, Any]:
        """The prefill leg: one token, no stream, one choice; ``reader``, the decode engine that will read its KV,
        if known."""
        request = dict(body, max_tokens=1, stream=False, n=1, **{wire.KV_TRANSFER_PARAMS: prefill_params(reader)})
        for name in self.limit_fields:
            if name in request:
                request[name] = 1
        request.pop("stream_options", None)
        # vLLM rejects min_tokens > max_tokens; the decode engine still gets the client's min_tokens.
        request.pop("min_tokens", None)
        return request

    # ---------------------------------------------------------------- a stream

    def continuation_refusal(self, body: dict[str, Any]) -> str | None:
        """Why a stream of ``body`` cannot be continued token for token on another engine
        (``proxy.continuation``); None if it can."""
        return refusal(body)

    def continued_choice(self, choice: dict[str, Any], ids: list[int], wants_ids: bool) -> dict[str, Any] | None:
        """A continuation's choice (a completion's) as this API's stream shows it; None: no event for it."""
        return dict(choice, prompt_token_ids=None, token_ids=ids if wants_ids else None)

    def generated(self, chunk: bytes) -> bool:
        """Whether a stream's chunk shows the engine generating (so it has loaded the KV)."""
        return True

    def error_event(self, failure: UpstreamFailed) -> bytes:
        """The event that ends a stream whose engine failed: the error body as a data event."""
        return b"data: " + orjson.dumps(failure.body()) + b"\n\n"


def prefill_params(reader: str | None) -> dict[str, Any]:
    """The prefill leg's ``kv_transfer_params``: keep the KV for a decode engine (``reader``, if known)."""
    params = dict(wire.PREFILL_REQUEST_PARAMS)
    if reader:
        params[wire.PDSERVE_READER] = reader
    return params


def plain_counts(body: dict[str, Any], counts: tuple[str, ...]) -> bool:
    """``model`` a non-empty string, ``stream`` a bool or unset, and each of ``counts`` a positive int or unset,
    as they come (no conversion): the part of ``plainly_valid`` chat and completions share."""
    model = body.get("model")
    if type(model) is not str or not model:
        return False
    stream = body.get("stream")
    if stream is not None and type(stream) is not bool:
        return False
    for name in counts:
        value = body.get(name)
        if value is not None and (type(value) is not int or value < 1):
            return False
    return True


def _param(loc: tuple[int | str, ...]) -> str | None:
    """The parameter a validation error is about: the field, then list indices (``messages.0``).

    Pydantic puts a union's member types in the location (``prompt.list[int]``); they name no parameter of the
    client's, so they and what follows are dropped."""
    parts = [str(loc[0])] if loc else []
    for part in loc[1:]:
        if not isinstance(part, int):
            break
        parts.append(str(part))
    return ".".join(parts) or None
