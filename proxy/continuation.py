"""A stream that outlives its decode engine: what it relayed, and how another engine continues it.

A greedy stream (``temperature`` 0, one choice) is *continuable* (``refusal`` says why another is not). Its decode
leg asks the engine for the token ids of what it generates (vLLM's ``return_token_ids``); ``StreamLedger.relay``
reads each event on its way to the client, keeps the prompt's token ids (the first event brings them) and those
sent, and gives the client the event as the engine would have sent it without the ids.

When the decode engine dies mid-stream, another engine continues the generation as a completion whose prompt is
the prompt's token ids followed by those already sent (``StreamLedger.continuation_body``; their KV computed
there), its ``max_tokens`` and ``min_tokens`` reduced by what was generated. A greedy continuation of prompt + sent
is the rest of the uninterrupted generation, token for token; text is never tokenized again (a boundary could
split otherwise). ``StreamLedger.continued`` rewrites the continuation's events in the client's format (a chat's
``delta``, the first stream's id, created and model) and its usage as the whole request's: the prompt's tokens,
and every token generated, on either engine.

What cannot be continued faithfully is refused (``refusal``), and such a stream ends with the error event as
before: sampled streams (seed or not: a seeded generator starts again on another engine), ``n`` > 1, logprobs,
stop strings (the engine holds back text that may start one), tools and structured output (their parser's and
grammar's state), presence and frequency penalties (they count only generated tokens), what an API's module
refuses (``GenerationApi.continuation_refusal``: the Responses API's streams, several prompts), and any field this
module does not know. A stream whose events show the engine parsing its output (tool calls,
reasoning) is refused from then on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from proxy.apis import GenerationApi

__all__ = ["StreamLedger", "refusal"]

COPIED = frozenset({
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos", "repetition_penalty",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "logit_bias",
    "allowed_token_ids", "priority", "cache_salt", "user", "stream_options",
})  # fmt: skip
"""Fields a continuation sends as the client did: the same sampling of the same model."""

KEPT = frozenset({
    "stream", "n", "max_tokens", "max_completion_tokens", "min_tokens", "return_token_ids", "prompt", "echo",
    "messages", "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
    "documents", "add_special_tokens", "truncate_prompt_tokens", "reasoning_effort", "parallel_tool_calls",
    "request_id", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "stop", "tools",
    "tool_choice", "response_format", "metadata", "store", "service_tier",
})  # fmt: skip
"""Fields a continuation keeps by other means (the prompt's token ids, reduced limits) or that ``refusal`` checks."""

_EMPTY = (None, False, 0, "", [], {}, "none")


def refusal(body: dict[str, Any], prompt_refusal: str | None = None) -> str | None:
    """Why a stream of ``body`` cannot be continued token for token on another engine; None if it can.
    ``prompt_refusal``: its API's reason about the prompt, if it has one (``GenerationApi.continuation_refusal``)."""
    temperature = body.get("temperature")
    if not isinstance(temperature, int | float) or temperature > 1e-5:
        shown = "the model's default" if temperature is None else repr(temperature)
        return f"it samples (temperature {shown}; only greedy streams, temperature 0, are continued)"
    if body.get("n") not in (None, 1):
        return "it has n > 1"
    for field in ("logprobs", "top_logprobs", "stop", "tools", "presence_penalty", "frequency_penalty"):
        if body.get(field) not in _EMPTY:
            return f"it sets {field}"
    if body.get("response_format") not in (None, {"type": "text"}):
        return "it sets response_format"
    if prompt_refusal is not None:
        return prompt_refusal
    unknown = sorted(set(body) - COPIED - KEPT)
    if unknown:
        return f"it sets {', '.join(unknown)}, which a continuation cannot keep"
    return None


class StreamLedger:
    """One continuable stream's record: the prompt's token ids, the tokens sent, the first event's id, and whether
    its end went out (see the module's docstring)."""

    __slots__ = (
        "api", "body", "wants_ids", "prompt_ids", "sent", "finished", "usage_sent", "done",
        "refused", "_head", "_buffer",
    )  # fmt: skip

    def __init__(self, body: dict[str, Any], api: GenerationApi) -> None:
        self.api, self.body = api, body
        self.wants_ids = bool(body.get("return_token_ids"))
        """The client asked for token ids itself: they stay in what it is sent."""
        self.prompt_ids: list[int] | None = None
        self.sent: list[int] = []
        """The token ids generated so far, on every engine, in order."""
        self.finished = False  # a finish_reason went out
        self.usage_sent = False
        self.done = False  # "data: [DONE]" went out
        self.refused: str | None = None
        """Found in the stream: why it cannot be continued after all (the engine parses its output)."""
        self._head: dict[str, Any] | None = None  # the first event's id, object, created, model
        self._buffer = b""

    @staticmethod
    def decode_request(body: dict[str, Any]) -> dict[str, Any]:
        """The decode leg's body asks for the ids of the tokens generated."""
        return body | {"return_token_ids": True}

    def relay(self, raw: bytes) -> bytes:
        """The first engine's bytes as the client gets them: whole events, token ids recorded and taken out."""
        return self._events(raw, self._original)

    def continued(self, raw: bytes) -> bytes:
        """A continuation's bytes (a completion's events) as the client gets them: in its own stream's format."""
        return self._events(raw, self._continuation)

    def _events(self, raw: bytes, rewrite: Any) -> bytes:
        if not self._buffer and raw.endswith(b"\n\n") and raw.find(b"\n\n") == len(raw) - 2:  # one whole event
            event = rewrite(raw[:-2])
            return b"" if event is None else event + b"\n\n"
        data = self._buffer + raw
        end = data.rfind(b"\n\n")
        if end < 0:
            self._buffer = data
            return b""
        self._buffer = data[end + 2 :]
        out = [event for event in map(rewrite, data[:end].split(b"\n\n")) if event is not None]
        return b"".join(event + b"\n\n" for event in out)

    def drop_partial(self) -> None:
        """The engine died mid-event: its part is never sent."""
        self._buffer = b""

    def restart(self) -> None:
        """Nothing reached the client: the stream starts again, from its first event, on another engine."""
        self.prompt_ids, self.sent, self.finished, self.usage_sent, self.done = None, [], False, False, False
        self.refused, self._head, self._buffer = None, None, b""

    # ------------------------------------------------------------------ the first engine's events

    def _original(self, event: bytes) -> bytes | None:
        chunk = _parse(event)
        if chunk is None:
            self.done = self.done or event.strip() == b"data: [DONE]"
            return event
        if self._head is None and "choices" in chunk:
            self._head = {key: chunk[key] for key in ("id", "object", "created", "model") if key in chunk}
        if "prompt_token_ids" in chunk:  # a chat's first event
            self._prompt(chunk["prompt_token_ids"])
            chunk["prompt_token_ids"] = chunk["prompt_token_ids"] if self.wants_ids else None
        if chunk.get("usage") is not None and not chunk.get("choices"):
            self.usage_sent = True
        shows_nothing = bool(chunk.get("choices")) and chunk.get("usage") is None
        for choice in chunk.get("choices") or ():
            if choice.get("prompt_token_ids") is not None:  # a completion's first event
                self._prompt(choice["prompt_token_ids"])
                choice["prompt_token_ids"] = choice["prompt_token_ids"] if self.wants_ids else None
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.sent += ids
                if not self.wants_ids:
                    choice["token_ids"] = None
            if choice.get("finish_reason") is not None:
                self.finished = True
            delta = choice.get("delta")
            if isinstance(delta, dict) and (parsed := delta.keys() - {"role", "content"}):
                self.refused = f"the engine parses its output ({', '.join(sorted(parsed))})"
            shows_nothing = shows_nothing and delta == {} and choice.get("finish_reason") is None
        if shows_nothing and not self.wants_ids:
            return None  # a chat's event for a token that shows no text: sent only because token ids were asked
        return b"data: " + orjson.dumps(chunk)

    def _prompt(self, ids: object) -> None:
        if self.prompt_ids is None and isinstance(ids, list):
            self.prompt_ids = ids

    # ------------------------------------------------------------------ a continuation

    def continuable(self) -> str | None:
        """Why this stream cannot be continued now; None if it can."""
        if self.refused is not None:
            return self.refused
        if self.prompt_ids is None or self._head is None:
            return "its prompt's token ids never came"
        return None

    def continuation_body(self) -> dict[str, Any]:
        """The completion that generates the rest: the prompt's and the sent tokens' ids as its prompt."""
        assert self.prompt_ids is not None
        body = self.body
        request = {key: body[key] for key in COPIED if key in body}
        request |= {"prompt": self.prompt_ids + self.sent, "stream": True, "return_token_ids": True}
        limit = next(
            (body[key] for key in ("max_completion_tokens", "max_tokens") if isinstance(body.get(key), int)), None
        )
        if limit is not None:
            request["max_tokens"] = max(limit - len(self.sent), 1)
        if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > len(self.sent):
            request["min_tokens"] = body["min_tokens"] - len(self.sent)
        return request

    def ending(self) -> bytes:
        """What a stream whose last token went out still owes the client: its usage (if asked) and its end."""
        out = b""
        if self._wants_usage() and not self.usage_sent and self.prompt_ids is not None:
            self.usage_sent = True
            usage = {"prompt_tokens": len(self.prompt_ids), "total_tokens": len(self.prompt_ids) + len(self.sent),
                     "completion_tokens": len(self.sent)}  # fmt: skip
            out += b"data: " + orjson.dumps((self._head or {}) | {"choices": [], "usage": usage}) + b"\n\n"
        if not self.done:
            self.done = True
            out += b"data: [DONE]\n\n"
        return out

    def _wants_usage(self) -> bool:
        options = self.body.get("stream_options")
        return isinstance(options, dict) and bool(options.get("include_usage"))

    def _continuation(self, event: bytes) -> bytes | None:
        chunk = _parse(event)
        if chunk is None:
            self.done = self.done or event.strip() == b"data: [DONE]"
            return event
        if "error" in chunk:
            return event
        assert self._head is not None and self.prompt_ids is not None
        out: dict[str, Any] = dict(self._head)
        choices = []
        for choice in chunk.get("choices") or ():
            ids = choice.get("token_ids") if isinstance(choice.get("token_ids"), list) else []
            self.sent += ids
            reason = choice.get("finish_reason")
            if reason is not None:
                self.finished = True
            shown = self.api.continued_choice(choice, ids, self.wants_ids)
            if shown is None:
                continue
            choices.append(shown)
        usage = chunk.get("usage")
        if not choices and usage is None:
            return None
        out["choices"] = choices
        if usage is not None:
            out["usage"] = self._whole_usage(usage)
            if not choices:
                self.usage_sent = True
        return b"data: " + orjson.dumps(out)

    def _whole_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """A continuation's usage as the request's: its prompt held the sent tokens, which the client counts as
        generated."""
        assert self.prompt_ids is not None
        prompt = len(self.prompt_ids)
        completion = len(self.sent)
        whole = dict(usage, prompt_tokens=prompt, total_tokens=prompt + completion, completion_tokens=completion)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            whole["prompt_tokens_details"] = dict(details, cached_tokens=min(details["cached_tokens"], prompt))
        return whole


def _parse(event: bytes) -> dict[str, Any] | None:
    """An event's JSON object, or None (``[DONE]``, a comment, anything else: relayed as it is)."""
    if not event.startswith(b"data: {"):
        return None
    try:
        chunk = orjson.loads(event[6:])
    except orjson.JSONDecodeError:
        return None
    return chunk if isinstance(chunk, dict) else None
