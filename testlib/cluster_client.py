"""A running cluster's client, as benchmarks and probes use it: ``pdserve`` commands, prompts of a known length,
and streamed completions timed token by token."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import urllib.request

PDSERVE = [sys.executable, "-m", "orchestrator.cli"]


ENGINE_HEADERS: dict[str, dict[str, str]] = {}
"""Per engine URL called directly: the cluster's engine key (engines answer only the proxy and its holders)."""


WORDS = (
    "the river carried old leaves past the mill while children counted boats and the baker sang about "
    "rain over the hills where a lighthouse keeper wrote letters to a friend across the sea "
).split()


def make_prompt(tag: int, approx_tokens: int) -> str:
    # These words are about one token each for SmolLM2's tokenizer; usage.prompt_tokens reports the truth.
    words = [WORDS[i % len(WORDS)] for i in range(approx_tokens - 12)]
    return f"Story {tag}: " + " ".join(words) + "\nSummarise the story in one sentence:"


def stream_tokens(url: str, body: dict, headers: dict[str, str]) -> tuple[float, list[float], dict | None]:
    """POST ``body`` to ``url``/v1/completions streamed: when it was sent, when each token came
    (``time.monotonic``), and the usage the last chunk reported (None without one)."""
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body | {"stream": True}).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    start = time.monotonic()
    token_times: list[float] = []
    usage = None
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            if event.get("choices") and event["choices"][0].get("text"):
                token_times.append(time.monotonic())
    return start, token_times, usage


def stream_completion(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    start, token_times, usage = stream_tokens(url, body, ENGINE_HEADERS.get(url, {}))
    gaps = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
    return {
        "ttft_s": token_times[0] - start,
        "itl_s": statistics.mean(gaps),
        "prompt_tokens": usage["prompt_tokens"] if usage else None,
        "chunks": len(token_times),
    }


def pdserve(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([*PDSERVE, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
