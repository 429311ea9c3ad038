"""A conversation's text, as routing reads it: shared by the chat and Responses APIs, whose prompts are messages
(``role``, ``content``) rendered by the engine's chat template."""

from __future__ import annotations

import sys
from typing import Any

import orjson

from proxy.apis.base import CHARS_PER_TOKEN

__all__ = ["TEXT_PARTS", "messages_prefix", "messages_tokens"]

TEXT_PARTS = ("text", "input_text", "output_text")
"""Content parts that are text: chat's, and the Responses API's."""


def messages_prefix(messages: list[dict[str, Any]], limit: int) -> str:
    """The conversation's first ``limit`` characters: each message's role and content in order (no chat template:
    only equality of prefixes matters)."""
    parts: list[str] = []
    length = 0
    for message in messages:
        part = f"{message.get('role')}\x1f{_content_text(message.get('content'))}\x1e"
        parts.append(part)
        length += len(part)
        if length >= limit:
            break
    return "".join(parts)[:limit]


def messages_tokens(messages: list[dict[str, Any]]) -> int:
    """The conversation's length in tokens: its text contents' characters / ``CHARS_PER_TOKEN``, rounded up, not
    the chat template's few tokens. A part that is not text (an image, audio) counts as long: never decode-only."""
    chars = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part in content:
                if not (isinstance(part, dict) and part.get("type") in TEXT_PARTS):
                    return sys.maxsize
                chars += len(str(part.get("text") or ""))
    return -(-chars // CHARS_PER_TOKEN)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    return orjson.dumps(content).decode()  # parts (text, images): their JSON stands for them
