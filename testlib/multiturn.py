"""Multi-turn chats against a running cluster: conversations of a seed, one streamed chat turn, the cluster
up and down."""

from __future__ import annotations

import json
import random
import sys
import time
import urllib.request
from typing import NamedTuple

from contract.headers import DECODE as DECODE_HEADER
from contract.headers import PATH as PATH_HEADER
from contract.headers import PREFILL as PREFILL_HEADER
from testlib.cluster_client import pdserve

MODEL = "smollm2-135m-instruct"
CPU_BLOCK_TOKENS = 128
"""vLLM's KV block on CPU engines (its default ``--block-size`` there)."""


TOPICS = (
    "a lighthouse keeper", "a river mill", "a mountain school", "a night train", "an old bakery",
    "a harbour storm", "a desert well", "a winter market", "a forest library", "a fishing village",
    "a clock tower", "a island ferry",
)  # fmt: skip


SENTENCES = (
    "The wind came from the north and the windows rattled all night.",
    "Someone had left a lantern burning on the stairs by the door.",
    "In the morning the road was covered with leaves and small branches.",
    "The children counted the boats that came back before noon.",
    "A letter arrived with a stamp that nobody in the town had seen before.",
    "The old map showed a path that no longer existed along the cliffs.",
    "By evening the bread was gone and the oven was still warm.",
    "Rain fell on the roofs while the bells rang for the third time.",
    "The keeper wrote every ship's name in a book with a green cover.",
    "Nobody could remember who had planted the tall trees by the gate.",
)


def user_message(rng: random.Random, topic: str, turn: int, sentences: int = 22) -> str:
    body = " ".join(rng.choice(SENTENCES) for _ in range(sentences))
    return f"Part {turn} of the story of {topic}. {body} What happens next? Answer in two sentences."


def conversations(count: int, seed: int, sentences: int = 22, first: int | None = None) -> list[list[str]]:
    """Per conversation, its user messages: 6-10 turns of ``sentences`` sentences (~13 tokens each), the first
    of ``first`` (a document the conversation is about)."""
    rng = random.Random(seed)
    talks = []
    for c in range(count):
        topic = TOPICS[c % len(TOPICS)] + (f" (number {c})" if c >= len(TOPICS) else "")
        turns = rng.randint(6, 10)
        talks.append([user_message(rng, topic, t + 1, sentences if t else (first or sentences)) for t in range(turns)])
    return talks


class Turn(NamedTuple):
    """One streamed greedy turn: its TTFT, answer, prompt tokens, the proxy's serving path, and the engine that
    computed its prompt (the prefill engine, or the one that served it alone)."""

    ttft_s: float
    answer: str
    prompt_tokens: int
    path: str
    engine: str


def stream_chat(proxy_url: str, messages: list[dict], max_tokens: int) -> Turn:
    """One streamed greedy turn (``Turn``)."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        proxy_url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    start, ttft, parts, prompt_tokens = time.perf_counter(), None, [], 0
    with urllib.request.urlopen(request, timeout=900) as response:
        path = response.headers.get(PATH_HEADER, "")
        engine = response.headers.get(PREFILL_HEADER) or response.headers.get(DECODE_HEADER, "")
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            for choice in event.get("choices", ()):
                text = choice.get("delta", {}).get("content")
                if text:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    parts.append(text)
            if event.get("usage"):
                prompt_tokens = event["usage"]["prompt_tokens"]
    if ttft is None:
        raise RuntimeError("the stream carried no content")
    return Turn(ttft, "".join(parts), prompt_tokens, path, engine)


def up(spec: str) -> str:
    started = pdserve("up", spec, "--detach")
    if started.returncode != 0:
        pdserve("down")
        sys.exit(f"pdserve up {spec} failed:\n{started.stdout}\n{started.stderr}")
    return json.loads(pdserve("status", "--json").stdout)["proxy_url"]


def down() -> None:
    stopped = pdserve("down")
    if stopped.returncode != 0:
        sys.exit(f"pdserve down failed:\n{stopped.stdout}\n{stopped.stderr}")
