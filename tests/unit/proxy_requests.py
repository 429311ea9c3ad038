"""What a client sends the proxy in the unit tests, and how its answers are read: the two OpenAI routes'
requests, the bodies the proxy must refuse, OpenAI's error format, SSE streams; ``wait_until`` for what
happens a little later."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import orjson
import pytest

from contract import wire
from tests.unit.conftest import PROXY_MODEL

CHAT_PATH, COMPLETION_PATH = "/v1/chat/completions", "/v1/completions"
CHAT = {"model": PROXY_MODEL, "messages": [{"role": "user", "content": "Say hello."}]}
COMPLETION = {"model": PROXY_MODEL, "prompt": "Say hello."}
REQUESTS = {CHAT_PATH: CHAT, COMPLETION_PATH: COMPLETION}
both_routes = pytest.mark.parametrize("path", [CHAT_PATH, COMPLETION_PATH], ids=["chat", "completion"])
both_roles = pytest.mark.parametrize("role", ["prefill", "decode"])

# What the prefill phase always sends, whatever the client asked for.
PREFILL_FIELDS = {"max_tokens": 1, "stream": False, "n": 1, "kv_transfer_params": wire.PREFILL_REQUEST_PARAMS}


def answer_of(path: str, payload: dict[str, Any]) -> str:
    choice = payload["choices"][0]
    return choice["message"]["content"] if path == CHAT_PATH else choice["text"]


def assert_openai_error(
    response: httpx.Response, status: int, *, error_type: str, code: Any = None, param: Any = None
) -> dict[str, Any]:
    """The response is ``status`` with OpenAI's error body; return its ``error`` object."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert (error["type"], error["code"], error["param"]) == (error_type, code, param)
    return error


def sse_events(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body: parsed JSON, or the raw string (``[DONE]``)."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block.removeprefix("data: ")
        events.append(data if data == "[DONE]" else orjson.loads(data))
    return events


def streamed_text(path: str, events: list[Any]) -> str:
    pieces = []
    for event in events:
        if event == "[DONE]" or not event["choices"]:
            continue
        choice = event["choices"][0]
        pieces.append(choice["delta"].get("content", "") if path == CHAT_PATH else choice["text"])
    return "".join(pieces)


async def wait_until(condition, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


INVALID_REQUESTS = [
    pytest.param(CHAT_PATH, {"model": PROXY_MODEL}, "messages", id="missing-messages"),
    pytest.param(CHAT_PATH, CHAT | {"messages": []}, "messages", id="empty-messages"),
    pytest.param(CHAT_PATH, CHAT | {"messages": "hi"}, "messages", id="messages-not-a-list"),
    pytest.param(CHAT_PATH, CHAT | {"max_tokens": 0}, "max_tokens", id="max-tokens-0"),
    pytest.param(CHAT_PATH, CHAT | {"max_completion_tokens": 0}, "max_completion_tokens", id="max-completion-0"),
    pytest.param(CHAT_PATH, CHAT | {"stream": "maybe"}, "stream", id="stream-not-bool"),
    pytest.param(CHAT_PATH, CHAT | {"stream": "false"}, "stream", id="stream-string"),
    pytest.param(CHAT_PATH, CHAT | {"stream": 1}, "stream", id="stream-int"),
    pytest.param(CHAT_PATH, CHAT | {"n": 0}, "n", id="n-0"),
    pytest.param(CHAT_PATH, {"messages": CHAT["messages"]}, "model", id="missing-model"),
    pytest.param(CHAT_PATH, CHAT | {"model": ""}, "model", id="empty-model"),
    pytest.param(COMPLETION_PATH, {"model": PROXY_MODEL}, "prompt", id="missing-prompt"),
    pytest.param(COMPLETION_PATH, COMPLETION | {"prompt": 5}, "prompt", id="prompt-not-text-or-tokens"),
    pytest.param(COMPLETION_PATH, COMPLETION | {"max_tokens": -1}, "max_tokens", id="completion-max-tokens"),
]


def json_header() -> dict[str, str]:
    return {"Content-Type": "application/json"}
