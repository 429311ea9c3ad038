"""A stub vLLM engine: the OpenAI routes of ``vllm serve`` with a KV connector, and nothing else.

It lets the proxy (``proxy.app``) be tested, and benchmarked, without Ray, vLLM
or a GPU. It runs in-process on an aiohttp server bound to ``127.0.0.1`` and an
ephemeral port, and answers ``POST /v1/chat/completions`` and
``POST /v1/completions`` the way a vLLM engine with ``NixlConnector`` does:

- A request whose ``kv_transfer_params.do_remote_decode`` is true is a
  *prefill*: the answer is a non-streaming completion of one token whose
  ``kv_transfer_params`` say where the KV blocks are
  (``do_remote_prefill: true``, ``remote_block_ids``, ``remote_engine_id``
  = the stub's name, ``remote_host``, ``remote_port``, ``tp_size``...).
- Any other request is a *decode* (or a plain request): the answer is the
  deterministic text ``answer_text(name, with_kv)``, e.g.
  ``"hello from decode-0 with kv_transfer_params"``, cut to ``max_tokens``
  words, as JSON or, when ``stream`` is true, as an SSE stream (one
  ``data: {...}`` chunk per word, a usage chunk when
  ``stream_options.include_usage``, then ``data: [DONE]``). With
  ``return_token_ids``, a stream's events carry token ids as vLLM's do: the
  prompt's (``PROMPT_IDS``) in the first, and each word's (``1000 +`` its
  position) in its own; without, those keys are null, as vLLM sends them. A
  completion whose prompt is token ids (``PROMPT_IDS`` and the ids of the first
  k words) generates the rest of the answer from word k: what a continuation
  of a stream asks.

``GET /v1/models`` lists ``model_name``; ``GET /health`` answers
``health_status`` (200); ``GET /metrics`` reports ``waiting`` and
``kv_cache_usage`` as vLLM's Prometheus gauges, followed by what
``extra_metrics()`` returns (after ``metrics_delay_s``); ``POST /tokenize``
answers one token id per word of the prompt (100, 101, ...);
``POST /v1/pdserve/tier_held`` answers that the shared KV tier holds
``tier_fraction`` of them (after ``tier_delay_s``), and counts the lookups in
``tier_lookups``.

It validates a little, like vLLM: a body that is not a JSON object, a missing
``messages``/``prompt``, ``max_tokens`` < 1 or ``min_tokens`` > ``max_tokens``
answer 400 with vLLM's error body.

Every request is recorded (``requests``: path, headers, body, and the
``kv_transfer_params`` the stub answered with). ``behaviour`` switches what the
stub does, at any time (see ``Behaviour``), and ``handler`` replaces the answer
altogether; ``stop()`` makes it *down* (connection refused) and ``start()``
brings it back on the same port.

Use::

    async with StubEngine("prefill-0") as prefill, StubEngine("decode-0") as decode:
        ...  # point the proxy at prefill.url and decode.url
        decode.behaviour = Behaviour.ERROR_500
        assert prefill.requests[0].body["max_tokens"] == 1

Or standalone (e.g. for a benchmark): ``python -m tests.stub_engine --name decode-0 --port 8200``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import itertools
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from contract import wire

__all__ = ["Behaviour", "ReceivedRequest", "StubEngine", "answer_text", "error_body"]


class Behaviour(enum.Enum):
    """What a stub does with the requests it receives."""

    OK = "ok"
    """Answer like vLLM with a KV connector (see the module's docstring)."""
    NO_KV = "no_kv"
    """Answer like vLLM without a KV connector: ``kv_transfer_params`` is null, even for a prefill."""
    ERROR_500 = "error_500"
    """Answer HTTP 500 with vLLM's error body (the engine failed)."""
    ERROR_400 = "error_400"
    """Answer HTTP 400 with vLLM's error body and ``ERROR_400_MESSAGE`` (the request is at fault)."""
    HANG = "hang"
    """Send nothing until ``hang_s`` has passed, ``release()`` or the stub is stopped; then answer as ``OK``
    (``/tokenize`` and ``/detokenize`` too)."""
    DROP = "drop"
    """Close the connection: before any answer if not streaming, after the first chunks if streaming."""
    STALL_MID_STREAM = "stall_mid_stream"
    """Streaming: send the first chunks, then nothing until ``hang_s`` has passed, ``release()`` or the stub
    is stopped.
    Not streaming: as ``HANG``."""


ERROR_400_MESSAGE = "This model's maximum context length is 16 tokens. However, you requested 4096 tokens."
CHUNKS_BEFORE_DROP = 2
"""Streaming ``DROP`` / ``STALL_MID_STREAM``: the number of SSE chunks sent before the failure."""


PROMPT_IDS = [1, 2]
"""The token ids of every text prompt the stub gets."""
FIRST_ID = 1000
"""The token id of a stub answer's first word; the next word's is one more."""


def answer_text(name: str, with_kv: bool) -> str:
    """The full text a stub called ``name`` generates; it says whether it got ``kv_transfer_params``."""
    return f"hello from {name} {'with' if with_kv else 'without'} kv_transfer_params"


def error_body(message: str, error_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's error body (``vllm.entrypoints.serve.engine.protocol.ErrorResponse``)."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


@dataclass
class ReceivedRequest:
    """One request a stub received."""

    path: str
    headers: dict[str, str]
    """Header names lower-cased."""
    body: Any
    """The parsed JSON body, or the raw bytes when it was not JSON."""
    answered_kv_transfer_params: dict[str, Any] | None = None
    """The ``kv_transfer_params`` the stub answered with (prefill requests only)."""
    disconnected: bool = False
    """True when the client went away before the stub finished answering."""
    peer: Any = None
    """The client's (host, port): requests sent on one kept-alive connection have the same."""

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        return self.body.get("kv_transfer_params") if isinstance(self.body, dict) else None

    @property
    def is_prefill(self) -> bool:
        return bool((self.kv_transfer_params or {}).get("do_remote_decode"))


Handler = Callable[[web.Request, ReceivedRequest], Awaitable[web.StreamResponse | None]]


@dataclass
class StubEngine:
    """An in-process stub of a vLLM engine's OpenAI server (see the module's docstring)."""

    name: str
    behaviour: Behaviour = Behaviour.OK
    host: str = "127.0.0.1"
    port: int = 0
    """0: an ephemeral port, chosen at the first ``start()`` and kept across restarts."""
    hang_s: float = 3600.0
    """How long ``HANG`` / ``STALL_MID_STREAM`` wait (``release()`` and ``stop()`` end the wait early)."""
    first_token_delay_s: float = 0.0
    """Latency before every answer (simulated prefill time), for benchmarks."""
    token_delay_s: float = 0.0
    """Latency between streamed chunks (simulated decode time), for benchmarks."""
    record: bool = True
    """Keep every request in ``requests``; a long benchmark may turn it off."""
    model_name: str = "stub-model"
    """The model ``GET /v1/models`` lists, as ``vllm serve --served-model-name`` would."""
    adapters: tuple[str, ...] = ()
    """LoRA adapters ``GET /v1/models`` lists after the model (``parent``: it), as ``--lora-modules`` would."""
    side_channel_port: int = 5600
    """``remote_port`` in the ``kv_transfer_params`` a prefill answers with."""
    release_endpoint: str | None = None
    """When set, a prefill's ``kv_transfer_params`` carry ``pdserve_release`` naming this ZMQ endpoint,
    as our connector's do (message ``PDRL <request id>``), and the ``pdserve_report`` message a decode
    engine's side channel answers (``PDKV <engine> <request id>``)."""
    kv_report: dict[str, Any] | None = None
    """When set, a decode answer's ``kv_transfer_params`` carry ``{"pdserve_kv": kv_report}``, as ours do."""
    health_status: int = 200
    """What ``GET /health`` answers: set 503 for an engine that is up but unwell."""
    health_delay_s: float = 0.0
    """How long ``GET /health`` waits before it answers."""
    waiting: float = 0
    """``vllm:num_requests_waiting`` on ``GET /metrics``."""
    kv_cache_usage: float = 0.0
    """``vllm:kv_cache_usage_perc`` (0-1) on ``GET /metrics``."""
    tier_fraction: float = 0.0
    """The share of a prompt's tokens ``POST /v1/pdserve/tier_held`` says the shared KV tier holds."""
    tier_delay_s: float = 0.0
    """How long ``POST /v1/pdserve/tier_held`` waits before it answers."""
    held_blocks: list[int] | None = None
    """When set, ``GET /v1/pdserve/kv_events`` streams one batch that stores these blocks (the engine's prefix cache
    holds them), then a heartbeat every 0.2 s; unset, the route answers 404 (an engine that does not relay)."""
    prompt_blocks: list[int] = field(default_factory=list)
    """The blocks ``POST /v1/pdserve/tier_held`` answers for any prompt (``wire.BLOCKS``)."""
    extra_metrics: Callable[[], str] | None = None
    """More Prometheus text for ``GET /metrics``, e.g. a test's histograms of what the stub served."""
    metrics_delay_s: float = 0.0
    """How long ``GET /metrics`` waits before it answers."""
    handler: Handler | None = None
    """A test's own answer, used instead of ``behaviour``: ``async def handler(request, received)``
    returning an ``aiohttp.web`` response, or None to answer as ``behaviour`` says (the request is
    recorded either way)."""
    requests: list[ReceivedRequest] = field(default_factory=list, init=False)
    health_probes: int = field(default=0, init=False)
    """``GET /health`` requests received."""
    tier_lookups: list[dict[str, Any]] = field(default_factory=list, init=False)
    """The body of each ``POST /v1/pdserve/tier_held``."""
    _runner: web.AppRunner | None = field(default=None, init=False, repr=False)
    _released: asyncio.Event | None = field(default=None, init=False, repr=False)
    _ids: itertools.count = field(default_factory=itertools.count, init=False, repr=False)

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> StubEngine:
        """Listen (again) on ``host:port``; idempotent."""
        if self._runner is not None:
            return self
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post(wire.RESPONSES_PATH, self._handle)
        app.router.add_post(wire.DETOKENIZE_PATH, self._detokenize)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post(wire.TIER_HELD_PATH, self._tier_held)
        app.router.add_get(wire.KV_EVENTS_PATH, self._kv_events)
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5, access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        self._runner, self._released = runner, asyncio.Event()
        return self

    async def stop(self) -> None:
        """Stop listening: the engine is *down* (connection refused) until ``start()``."""
        if self._runner is None:
            return
        runner, self._runner = self._runner, None
        self.release()
        await runner.cleanup()

    def release(self) -> None:
        """End the ``HANG`` / ``STALL_MID_STREAM`` waits under way: they answer as ``OK`` from there on.
        Requests that arrive later wait again."""
        if self._released is not None:
            self._released.set()
            self._released = asyncio.Event()

    @property
    def running(self) -> bool:
        return self._runner is not None

    async def __aenter__(self) -> StubEngine:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        """The base URL, e.g. ``http://127.0.0.1:41234`` (``start()`` first)."""
        if not self.port:
            raise RuntimeError(f"stub engine {self.name} was never started")
        return f"http://{self.host}:{self.port}"

    # --- what was received -------------------------------------------------------------

    @property
    def prefill_requests(self) -> list[ReceivedRequest]:
        return [r for r in self.requests if r.is_prefill]

    @property
    def decode_requests(self) -> list[ReceivedRequest]:
        return [r for r in self.requests if not r.is_prefill]

    def reset(self) -> None:
        """Forget the requests received and go back to ``Behaviour.OK`` (and no ``handler``)."""
        self.requests.clear()
        self.behaviour, self.handler = Behaviour.OK, None

    # --- serving -----------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        self.health_probes += 1
        if self.health_delay_s:
            await self._wait(self.health_delay_s)
        return web.Response(status=self.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics_delay_s:
            await self._wait(self.metrics_delay_s)
        labels = f'{{engine="0",model_name="{self.model_name}"}}'
        text = (
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{labels} {float(self.waiting)}\n"
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{labels} {float(self.kv_cache_usage)}\n"
        )
        if self.extra_metrics is not None:
            text += self.extra_metrics()
        return web.Response(text=text, content_type="text/plain")

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        if self.behaviour is Behaviour.HANG:
            await self._wait(self.hang_s)
        tokens = [100 + i for i, _ in enumerate(str(body.get("prompt", "")).split())]
        return _json({"count": len(tokens), "max_model_len": 4096, "tokens": tokens, "token_strs": None})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        if self.behaviour is Behaviour.HANG:
            await self._wait(self.hang_s)
        return _json({"prompt": " ".join(f"w{t}" for t in body.get("tokens", []))})

    async def _tier_held(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        self.tier_lookups.append({"body": body})
        await asyncio.sleep(self.tier_delay_s)
        text = body.get("prompt") if "prompt" in body else " ".join(str(m.get("content")) for m in body["messages"])
        tokens = len(str(text).split())
        held = int(tokens * self.tier_fraction)
        tiers = {wire.SHARED_TIER: held, "node": 0}
        return _json({wire.PROMPT_TOKENS: tokens, wire.BLOCKS: self.prompt_blocks, wire.TIERS: tiers})

    async def _kv_events(self, request: web.Request) -> web.StreamResponse:
        if self.held_blocks is None:
            return web.Response(status=404)
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(orjson.dumps({"epoch": self.name, "block_size": 16}) + b"\n")
        batch = {"seq": 0, "stored": self.held_blocks, "removed": [], "cleared": False}
        await response.write(orjson.dumps(batch) + b"\n")
        while self._runner is not None:
            await asyncio.sleep(0.2)
            await response.write(b"{}\n")
        return response

    async def _models(self, request: web.Request) -> web.Response:
        if self.behaviour is Behaviour.ERROR_500:
            return _json(error_body(f"{self.name}: engine core died", "InternalServerError", 500), 500)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "vllm", "root": self.model_name}
        adapters = [
            model | {"id": name, "root": f"/adapters/{name}", "parent": self.model_name} for name in self.adapters
        ]
        return _json({"object": "list", "data": [model, *adapters]})

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = raw
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        received = ReceivedRequest(request.path, {k.lower(): v for k, v in request.headers.items()}, body, peer=peer)
        if self.record:
            self.requests.append(received)
        try:
            if self.handler is not None:
                response = await self.handler(request, received)
                if response is not None:
                    return response
            return await self._answer(request, received)
        except asyncio.CancelledError:
            received.disconnected = True
            raise

    async def _answer(self, request: web.Request, received: ReceivedRequest) -> web.StreamResponse:
        behaviour, body = self.behaviour, received.body
        if behaviour is Behaviour.ERROR_500:
            return _json(error_body(f"{self.name}: engine core died", "InternalServerError", 500), 500)
        if behaviour is Behaviour.ERROR_400:
            return _json(error_body(ERROR_400_MESSAGE, "BadRequestError", 400), 400)
        problem = _validate(request.path, body)
        if problem:
            return _json(error_body(problem, "BadRequestError", 400), 400)
        streaming = bool(body.get("stream")) and not received.is_prefill
        if behaviour is Behaviour.HANG or (behaviour is Behaviour.STALL_MID_STREAM and not streaming):
            await self._wait(self.hang_s)
        if behaviour is Behaviour.DROP and not streaming:
            _abort(request)
            return web.Response(status=500)  # never sent: the connection is gone
        if self.first_token_delay_s:
            await asyncio.sleep(self.first_token_delay_s)

        request_id = received.headers.get("x-request-id") or f"stub-{self.name}-{next(self._ids)}"
        chat = request.path.endswith("/chat/completions")
        responses = request.path == wire.RESPONSES_PATH
        if received.is_prefill:
            kv_params = None if behaviour is Behaviour.NO_KV else self._kv_transfer_params(request_id)
            received.answered_kv_transfer_params = kv_params
            words, finish = ["hello"], "length"
        else:
            kv_params = {"pdserve_kv": self.kv_report} if self.kv_report and received.kv_transfer_params else None
            text = answer_text(self.name, received.kv_transfer_params is not None)
            prompt = body.get("prompt")
            start = len(prompt) - len(PROMPT_IDS) if isinstance(prompt, list) and prompt and prompt[0] == 1 else 0
            words, finish = _limit(" ".join(text.split(" ")[start:]), body)
        n = body["n"] if isinstance(body.get("n"), int) and body["n"] > 0 else 1
        if responses and not streaming:
            return _json(_response(request_id, body, words, kv_params))
        if responses:
            return await self._send_events(request, _response_events(request_id, body, words))
        if not streaming:
            return _json(_completion(chat, request_id, body, words, finish, n, kv_params))
        return await self._stream(request, chat, request_id, body, words, finish, n, start)

    async def _send_events(self, request: web.Request, events: list[dict[str, Any]]) -> web.StreamResponse:
        """A Responses API stream: ``event:`` and ``data:`` lines, no ``[DONE]``."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for number, event in enumerate(events):
            if number == CHUNKS_BEFORE_DROP + 2 and self.behaviour is Behaviour.DROP:  # after its preamble
                _abort(request)
                return response
            if number > 2 and self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            await response.write(f"event: {event['type']}\ndata: ".encode() + orjson.dumps(event) + b"\n\n")
        await response.write_eof()
        return response

    async def _stream(
        self,
        request: web.Request,
        chat: bool,
        request_id: str,
        body: dict,
        words: list[str],
        finish: str,
        n: int,
        start: int = 0,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for number, chunk in enumerate(_chunks(chat, request_id, body, words, finish, n, start)):
            if number == CHUNKS_BEFORE_DROP and self.behaviour is Behaviour.DROP:
                _abort(request)
                return response
            if number == CHUNKS_BEFORE_DROP and self.behaviour is Behaviour.STALL_MID_STREAM:
                await self._wait(self.hang_s)
            if number and self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _wait(self, seconds: float) -> None:
        assert self._released is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._released.wait(), seconds)

    def _kv_transfer_params(self, request_id: str) -> dict[str, Any]:
        """What vLLM's NixlConnector answers a prefill with (``request_finished``)."""
        release = {
            "pdserve_release": {"endpoints": [self.release_endpoint], "message": f"PDRL {request_id}"},
            "pdserve_report": {"message": f"PDKV {self.name} {request_id}"},
        }
        return (release if self.release_endpoint else {}) | {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[1, 2]],
            "remote_engine_id": self.name,
            "remote_request_id": request_id,
            "remote_host": self.host,
            "remote_port": self.side_channel_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": 2,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
        }


# --- vLLM's answers -----------------------------------------------------------------------


def _validate(path: str, body: Any) -> str | None:
    """The few checks of vLLM's that matter to a proxy; a message for a 400, or None."""
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    required = (
        "messages" if path.endswith("/chat/completions") else "input" if path == wire.RESPONSES_PATH else "prompt"
    )
    if body.get(required) is None:
        return f"Field required: {required}"
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        return f"max_tokens must be at least 1, got {max_tokens}."
    min_tokens = body.get("min_tokens") or 0
    if not isinstance(min_tokens, int) or min_tokens < 0:
        return f"min_tokens must be greater than or equal to 0, got {min_tokens}."
    if max_tokens is not None and min_tokens > max_tokens:
        return f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
    return None


def _limit(text: str, body: dict) -> tuple[list[str], str]:
    """The words of ``text`` cut to the request's max tokens (one word a token), and the finish reason."""
    words = text.split(" ")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens")
    if max_tokens is not None and max_tokens < len(words):
        return words[:max_tokens], "length"
    return words, "stop"


def _usage(words: list[str], n: int, prompt: int = len(PROMPT_IDS)) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": len(words) * n, "total_tokens": prompt + len(words) * n}


def _completion(
    chat: bool, request_id: str, body: dict, words: list[str], finish: str, n: int, kv: dict | None
) -> dict[str, Any]:
    text = " ".join(words)
    if chat:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
            for i in range(n)
        ]
    else:
        choices = [
            {"index": i, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None} for i in range(n)
        ]
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": body.get("model"),
        "choices": choices,
        "usage": _usage(words, n),
        "prompt_logprobs": None,
        "kv_transfer_params": kv,
    }


def _chunks(
    chat: bool, request_id: str, body: dict, words: list[str], finish: str, n: int, start: int = 0
) -> list[dict[str, Any]]:
    """The SSE chunks of a streamed answer, without ``[DONE]``; ``start``: the position of its first word in
    the whole answer (a continuation's)."""
    ids = bool(body.get("return_token_ids"))
    prompt = body["prompt"] if isinstance(body.get("prompt"), list) else PROMPT_IDS
    header = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": body.get("model"),
    }

    def choice(i: int, piece: str | None, finish_reason: str | None, position: int) -> dict[str, Any]:
        token_ids = [FIRST_ID + start + position] if ids and piece is not None else None
        if chat:
            delta = {"role": "assistant", "content": ""} if piece is None else {"content": piece}
            shown = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            if finish_reason is not None:
                shown["stop_reason"] = None
            return shown | {"token_ids": token_ids}
        return {
            "index": i, "text": piece or "", "logprobs": None, "finish_reason": finish_reason, "stop_reason": None,
            "prompt_token_ids": prompt if ids and position == 0 else None, "token_ids": token_ids,
        }  # fmt: skip

    chunks = []
    if chat:
        first = {"prompt_token_ids": prompt if ids else None}
        chunks += [header | {"choices": [choice(i, None, None, 0)]} | first for i in range(n)]
    for position, word in enumerate(words):
        last = position == len(words) - 1
        piece = word if position + start == 0 else " " + word
        chunks += [header | {"choices": [choice(i, piece, finish if last else None, position)]} for i in range(n)]
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append(header | {"choices": [], "usage": _usage(words, n, len(prompt))})
    return chunks


def _response(request_id: str, body: dict, words: list[str], kv: dict | None, status: str = "completed") -> dict:
    """A Responses API answer (``POST /v1/responses``), as vLLM's ``ResponsesResponse``."""
    text = " ".join(words)
    message = {
        "type": "message", "id": f"msg_{request_id}", "role": "assistant", "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else [],
    }  # fmt: skip
    return {
        "id": f"resp_{request_id}",
        "object": "response",
        "created_at": int(time.time()),
        "model": body.get("model"),
        "status": status,
        "output": [message] if status == "completed" else [],
        "usage": {"input_tokens": 2, "output_tokens": len(words), "total_tokens": 2 + len(words)},
        "kv_transfer_params": kv,
    }


def _response_events(request_id: str, body: dict, words: list[str]) -> list[dict[str, Any]]:
    """A streamed Responses API answer's events, in vLLM's order: the preamble it sends before the engine ran
    (created, in progress), the message's item and part, a delta per word, their ends, completed."""
    started = _response(request_id, body, [], None, status="in_progress")
    item = {"type": "message", "id": f"msg_{request_id}", "role": "assistant", "status": "in_progress", "content": []}
    text = " ".join(words)
    part = {"type": "output_text", "text": "", "annotations": []}
    where = {"item_id": item["id"], "output_index": 0, "content_index": 0}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": started},
        {"type": "response.in_progress", "response": started},
        {"type": "response.output_item.added", "output_index": 0, "item": item},
        {"type": "response.content_part.added", **where, "part": part},
    ]
    events += [
        {"type": "response.output_text.delta", **where, "delta": word if i == 0 else " " + word}
        for i, word in enumerate(words)
    ]
    events += [
        {"type": "response.output_text.done", **where, "text": text},
        {"type": "response.content_part.done", **where, "part": part | {"text": text}},
        {"type": "response.output_item.done", "output_index": 0, "item": item | {"status": "completed"}},
        {"type": "response.completed", "response": _response(request_id, body, words, None)},
    ]
    return [event | {"sequence_number": n} for n, event in enumerate(events)]


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


def _abort(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.abort()


# --- standalone ---------------------------------------------------------------------------


async def _serve_forever(engine: StubEngine) -> None:
    async with engine:
        print(f"stub engine {engine.name} ({engine.behaviour.value}) listening on {engine.url}", flush=True)
        await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="stub-0", help="the engine's name (remote_engine_id, answer text)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: an ephemeral port")
    parser.add_argument("--model-name", default="stub-model", help="the model /v1/models lists")
    parser.add_argument("--behaviour", choices=[b.value for b in Behaviour], default=Behaviour.OK.value)
    parser.add_argument("--first-token-delay-s", type=float, default=0.0)
    parser.add_argument("--token-delay-s", type=float, default=0.0)
    args = parser.parse_args(argv)
    engine = StubEngine(
        args.name,
        behaviour=Behaviour(args.behaviour),
        host=args.host,
        port=args.port,
        model_name=args.model_name,
        first_token_delay_s=args.first_token_delay_s,
        token_delay_s=args.token_delay_s,
        record=False,
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_forever(engine))


if __name__ == "__main__":
    main()
