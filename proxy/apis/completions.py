"""``POST /v1/completions``: OpenAI's (legacy) completions, as vLLM serves them: a text or token-id prompt, or a
batch of them."""

from __future__ import annotations

from typing import Any

from contract import wire
from proxy.apis.base import CHARS_PER_TOKEN, GenerationApi, OpenAIRequest, plain_counts
from proxy.continuation import refusal

__all__ = ["CompletionRequest", "Completions"]


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str] | list[int] | list[list[int]]


class Completions(GenerationApi):
    name = "completion"
    path = wire.COMPLETIONS_PATH
    request_model = CompletionRequest
    prompt_field = "prompt"
    limit_fields = ("max_tokens",)

    def plainly_valid(self, body: dict[str, Any]) -> bool:
        if not plain_counts(body, ("max_tokens", "n")):
            return False
        prompt = body.get("prompt")
        if type(prompt) is str:
            return True
        if type(prompt) is not list:
            return False
        return (
            all(type(p) is str for p in prompt)
            or all(type(p) is int for p in prompt)
            or all(type(p) is list and all(type(t) is int for t in p) for p in prompt)
        )

    def prefix_text(self, body: dict[str, Any], limit: int) -> str | list[int]:
        """A batch is routed by its first prompt."""
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt[:limit]
        return prompt[:limit] if isinstance(prompt, list) else []

    def estimate_tokens(self, body: dict[str, Any]) -> int:
        """Token-id prompts: their length; text: characters / 4, rounded up. A batch counts all its prompts."""
        prompt = body["prompt"]
        if isinstance(prompt, str):
            return -(-len(prompt) // CHARS_PER_TOKEN)
        if not prompt or isinstance(prompt[0], int):
            return len(prompt)
        if isinstance(prompt[0], str):
            return sum(-(-len(p) // CHARS_PER_TOKEN) for p in prompt)
        return sum(len(p) for p in prompt)

    def continuation_refusal(self, body: dict[str, Any]) -> str | None:
        return refusal(body, None if _one_prompt(body.get("prompt")) else "it has several prompts")


def _one_prompt(prompt: object) -> bool:
    if isinstance(prompt, str):
        return True
    if isinstance(prompt, list) and prompt:
        return all(isinstance(t, int) for t in prompt) or (len(prompt) == 1 and not isinstance(prompt[0], dict))
    return False
