"""Clients of a real cluster under a kill: each sends requests one after another while an engine is killed.

``kill_under_load`` runs them and kills; ``mixed_send`` makes the clients of ``CLIENT_MIX`` (greedy requests,
streamed and not, chat and completions, and one sampled stream); ``kill_outcome`` sorts what they saw;
``answers_equal`` asks again, uninterrupted, what went on on another engine and checks the answers match.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

CHAT_PATH, COMPLETION_PATH = "/v1/chat/completions", "/v1/completions"
GREEDY = {"temperature": 0, "max_tokens": 64}
CLIENT_MIX = (
    (CHAT_PATH, {}),
    (CHAT_PATH, {"stream": True}),
    (COMPLETION_PATH, {"stream": True}),
    (COMPLETION_PATH, {}),
    (CHAT_PATH, {"stream": True, "stream_options": {"include_usage": True}}),
    (CHAT_PATH, {"stream": True, "temperature": 0.8, "seed": 1}),  # a sampled stream: not continued
    (COMPLETION_PATH, {"temperature": 0.8, "seed": 2}),  # seeded, not streamed: moved, the same tokens
)
"""Each client's route and what its greedy requests add (``mixed_send``)."""


def ask(url: str, body: dict) -> tuple[int, dict]:
    """A request's status and what the client saw: its text, usage, error, SSE comments, stream ids and the
    X-PDServe headers (path, migrated)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    seen: dict = {"text": "", "usage": None, "error": None, "comments": [], "done": 0, "ids": set(), "path": ""}
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            status, raw = response.status, response.read().decode()
            seen |= {"path": response.headers.get("x-pdserve-path", ""),
                     "migrated": response.headers.get("x-pdserve-migrated")}  # fmt: skip
    except urllib.error.HTTPError as e:
        return e.code, seen | {"error": e.read().decode()}
    except OSError as e:
        return 0, seen | {"error": f"no answer: {e}"}
    if not body.get("stream"):
        answer = json.loads(raw)
        choice = answer["choices"][0]
        seen["text"] = choice["message"]["content"] if "message" in choice else choice["text"]
        return status, seen | {"usage": answer["usage"], "done": 1}
    for block in filter(None, raw.split("\n\n")):
        if block.startswith(":"):
            seen["comments"].append(block)
        elif block == "data: [DONE]":
            seen["done"] += 1
        else:
            event = json.loads(block.removeprefix("data: "))
            if "error" in event:
                seen["error"] = event["error"]
                continue
            seen["ids"].add(event["id"])
            seen["usage"] = event.get("usage") or seen["usage"]
            for choice in event["choices"]:
                seen["text"] += (choice["delta"].get("content") or "") if "delta" in choice else choice["text"]
    return status, seen


def mixed_send(proxy_url: str, model: str, topic: str, max_tokens: int = 64) -> Callable[[int, int], tuple]:
    """``send(n, i)`` for ``kill_under_load``: client n's i-th request, as ``CLIENT_MIX[n]`` makes it; its outcome
    ``(status, seen, path, body)``."""

    def send(n: int, i: int) -> tuple[int, dict, str, dict]:
        path, extra = CLIENT_MIX[n]
        question = f"Client {n}, question {i}: {topic}."
        prompt = {"messages": [{"role": "user", "content": question}]} if path == CHAT_PATH else {"prompt": question}
        body = {"model": model, **prompt, **GREEDY, "max_tokens": max_tokens, **extra}
        return (*ask(proxy_url + path, body), path, body)

    return send


def kill_under_load(
    pid: int,
    clients: int,
    send: Callable[[int, int], tuple],
    disaggregated: Callable[[tuple], bool],
    when: Callable[[], bool] | None = None,
) -> tuple[list[tuple], float]:
    """``clients`` threads each send requests one after another (``send(n, i)``: client n's i-th, its outcome);
    once ``clients`` results are ``disaggregated`` (and then ``when()`` holds, if given: up to 120 s more), kill -9
    ``pid``; they go on until ``clients`` requests were sent 2 s after the kill. Returns each request's
    ``(sent, answered, *outcome)`` and when the kill came."""
    results: list[tuple] = []
    stop = threading.Event()

    def client(n: int) -> None:
        i = 0
        while not stop.is_set():
            sent = time.monotonic()
            outcome = send(n, i)
            results.append((sent, time.monotonic(), *outcome))
            i += 1

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(clients)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while sum(1 for r in results if disaggregated(r)) < clients and time.monotonic() < deadline:
        time.sleep(0.2)
    deadline = time.monotonic() + 120
    while when is not None and not when() and time.monotonic() < deadline:
        time.sleep(0.05)
    kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while sum(1 for r in results if r[0] > kill + 2) < clients and time.monotonic() < deadline:
        time.sleep(0.2)
    stop.set()
    for thread in threads:
        thread.join(timeout=300)
    return results, kill


@dataclass
class Result:
    sent: float
    answered: float
    status: int
    seen: dict
    path: str
    body: dict


@dataclass
class Outcome:
    """What ``mixed_send``'s clients saw of a kill."""

    faithful: list[Result] = field(default_factory=list)
    """Requests that must come out as they would without the kill: greedy ones, and seeded ones not streamed."""
    in_flight: list[Result] = field(default_factory=list)
    """Those sent before the kill and answered after it."""
    failed: list[Result] = field(default_factory=list)
    """Those that did not end well: not 200, an error event, or not one ``[DONE]``."""
    moved: list[Result] = field(default_factory=list)
    """Non-streamed requests another engine answered (``X-PDServe-Migrated``)."""
    continued: list[Result] = field(default_factory=list)
    """Streams continued on another engine mid-stream (the proxy's SSE comment says so)."""
    sampled_ended: list[Result] = field(default_factory=list)
    """Sampled streams that ended with an error event."""

    def to_compare(self) -> list[Result]:
        """What ``answers_equal`` asks again: every seeded request that moved, two greedy ones, three streams."""
        seeded = [r for r in self.moved if r.body["temperature"] != 0]
        return seeded + [r for r in self.moved if r.body["temperature"] == 0][:2] + self.continued[:3]

    def __str__(self) -> str:
        return (
            f"{len(self.faithful)} greedy or seeded requests, {len(self.in_flight)} in flight at the kill, "
            f"{len(self.failed)} failed, {len(self.moved)} moved and {len(self.continued)} streams continued on "
            "another engine; "
            f"{len(self.sampled_ended)} sampled streams ended with an error event"
        )


def kill_outcome(results: list[tuple], kill: float) -> Outcome:
    outcome = Outcome()
    for result in (Result(*r) for r in results):
        seen = result.seen
        if result.body["temperature"] != 0 and result.body.get("stream"):
            if seen["error"]:
                outcome.sampled_ended.append(result)
            continue
        outcome.faithful.append(result)
        if result.sent < kill < result.answered:
            outcome.in_flight.append(result)
        if result.status != 200 or seen["error"] or seen["done"] != 1 or len(seen["ids"]) > 1:
            outcome.failed.append(result)
        if seen.get("migrated"):
            outcome.moved.append(result)
        if seen["comments"]:
            outcome.continued.append(result)
    return outcome


def answers_equal(proxy_url: str, results: list[Result]) -> int:
    """Ask each request again, with no engine failing: the same text and usage (a greedy answer does not
    depend on the engines it went through). Returns how many were compared."""
    for result in results:
        status, again = ask(proxy_url + result.path, result.body)
        assert status == 200 and not again["comments"] and not again.get("migrated"), again
        assert (again["text"], again["usage"]) == (result.seen["text"], result.seen["usage"]), (result, again)
    return len(results)
