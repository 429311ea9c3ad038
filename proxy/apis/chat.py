"""``POST /v1/chat/completions``: OpenAI's chat completions, as vLLM serves them."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from contract import wire
from proxy.apis.base import GenerationApi, OpenAIRequest, plain_counts
from proxy.apis.messages import messages_prefix, messages_tokens

__all__ = ["Chat", "ChatRequest"]


class ChatRequest(OpenAIRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class Chat(GenerationApi):
    name = "chat"
    path = wire.CHAT_PATH
    request_model = ChatRequest
    prompt_field = "messages"
    limit_fields = ("max_completion_tokens", "max_tokens")

    def plainly_valid(self, body: dict[str, Any]) -> bool:
        if not plain_counts(body, ("max_tokens", "n", "max_completion_tokens")):
            return False
        messages = body.get("messages")
        return type(messages) is list and bool(messages) and all(type(m) is dict for m in messages)

    def prefix_text(self, body: dict[str, Any], limit: int) -> str:
        return messages_prefix(body["messages"], limit)

    def estimate_tokens(self, body: dict[str, Any]) -> int:
        return messages_tokens(body["messages"])

    def continued_choice(self, choice: dict[str, Any], ids: list[int], wants_ids: bool) -> dict[str, Any] | None:
        """A chat's ``delta``; no event for a token that shows no text yet (a chat stream sends none)."""
        text = choice.get("text") or ""
        reason = choice.get("finish_reason")
        if not text and reason is None and not wants_ids:
            return None
        shown: dict[str, Any] = {
            "index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": reason
        }  # fmt: skip
        if reason is not None:
            shown["stop_reason"] = choice.get("stop_reason")
        shown["token_ids"] = ids if wants_ids else None
        return shown
