"""A request's prompt as an engine's KV caches see it, for the proxy's routing: its blocks, and how many of its
tokens the engine's filesystem KV tiers hold.

``POST /v1/pdserve/tier_held`` (``wire.TIER_HELD_PATH``) with the body of a chat request (its
``messages``) or a completion request (its ``prompt``) answers
``{"prompt_tokens": N, "blocks": [h, ...], "tiers": {"shared": S, "node": M}}``:

- ``prompt_tokens``: the prompt as this engine renders and tokenizes it, with vLLM's own chat template
  and tokenizer (its ``/tokenize`` handler);
- ``blocks``: its full blocks at the engine's block size, hashed as the engine's scheduler hashes them and
  named as its KV events name them (``connectors.kv_events.external_hash``), which the proxy looks up in what
  each engine's events say it holds;
- per filesystem tier, the leading prompt tokens whose chunks are all stored: what the engine's
  scheduler would load from that tier, looked up the way it looks them up. The prompt's token blocks
  are hashed with vLLM's ``hash_block_tokens`` and the engine's hash algorithm (the chain starts from
  vLLM's seed; ``cache_salt`` goes into the first block, as vLLM adds it). A chunk's key is the hash of
  its last block (vLLM's ``OffloadingConnector``), its file is named by vLLM's ``FileMapper``, and the
  chunks are looked up in order, one ``stat`` each, up to the first one missing.

The file names depend on the KV cache's layout, which only the engine core knows (the HTTP server is a
process of its own). Each tier writes its naming to ``$PDSERVE_KV_TIER_LAYOUTS/<tier>.json`` when it
opens (``write_layout``, from ``connectors.tier.fs_tier``); this side reads it (``TierLayout``).

The answer is an estimate for routing, never a promise: an entry evicted, or found corrupt, after it
was counted is computed again by the engine that misses it. A request this side cannot hash as the
engine would (non-text parts such as images, a LoRA adapter, prompt embeddings, a hash algorithm
seeded at random per process) is answered with nothing held.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from connectors.kv_events import external_hash
from connectors.tier import LAYOUT_ENV
from contract import wire
from contract.private_files import make_private_dirs, write_private

__all__ = ["TierLayout", "add_route", "block_hashes", "held_tokens", "read_layouts", "write_layout"]

CHAT_FIELDS = (
    "model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
    "chat_template", "chat_template_kwargs", "tools",
)  # fmt: skip
"""What of a chat completion request decides its prompt's tokens (``TokenizeChatRequest``'s fields)."""
COMPLETION_FIELDS = ("model", "prompt", "add_special_tokens")


@dataclass(frozen=True, slots=True)
class TierLayout:
    """How one filesystem tier of an engine names its entries."""

    name: str
    base_path: str
    """``FileMapper.base_path``: the tier's namespace (format, layout, model, dtype, block size, layers)."""
    rank: int
    tokens_per_hash: int
    groups: tuple[tuple[int, int], ...]
    """Per KV cache group: (group index, block hashes per chunk)."""

    def file_name(self, block_hash: bytes, group_idx: int) -> str:
        from vllm.v1.kv_offload.base import make_offload_key
        from vllm.v1.kv_offload.file_mapper import FileMapper

        mapper = FileMapper.__new__(FileMapper)  # vLLM's naming only: get_file_name reads these two
        mapper.base_path, mapper.rank = self.base_path, self.rank
        return mapper.get_file_name(make_offload_key(block_hash, group_idx))

    def to_json(self) -> str:
        return json.dumps({
            "name": self.name, "base_path": self.base_path, "rank": self.rank,
            "tokens_per_hash": self.tokens_per_hash, "groups": [list(g) for g in self.groups],
        })  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> TierLayout:
        data = json.loads(text)
        groups = tuple((int(g), int(n)) for g, n in data["groups"])
        return cls(str(data["name"]), str(data["base_path"]), int(data["rank"]), int(data["tokens_per_hash"]), groups)


def write_layout(name: str, base_path: str, rank: int, spec: Any) -> Path | None:
    """Write tier ``name``'s naming (``spec``: its ``OffloadingSpec``) where ``$PDSERVE_KV_TIER_LAYOUTS`` says;
    the file written, or None where it is unset. Written whole or not at all (a rename)."""
    directory = os.environ.get(LAYOUT_ENV)
    if not directory:
        return None
    groups = tuple(
        (g.group_id, g.tokens_per_block * spec.blocks_per_chunk // spec.tokens_per_hash) for g in spec.config.groups
    )
    layout = TierLayout(name, base_path, rank, spec.tokens_per_hash, groups)
    path = Path(directory) / f"{name}.json"
    make_private_dirs(path.parent)
    write_private(path, layout.to_json())  # 0600: it names the tier's directory and the model
    return path


def read_layouts(directory: Path) -> list[TierLayout]:
    """The layouts the engine's tiers wrote into ``directory`` (none before they opened)."""
    try:
        names = sorted(directory.glob("*.json"))
    except OSError:
        return []
    return [TierLayout.from_json(path.read_text()) for path in names]


def block_hashes(
    tokens: Sequence[int], tokens_per_hash: int, hash_algo: str, cache_salt: str | None = None
) -> list[bytes] | None:
    """vLLM's chained hashes of the prompt's full blocks, as the engine core computes them (its request
    block hasher, for a text request); None where they are not reproducible outside the engine core (a
    non-cryptographic algorithm without ``PYTHONHASHSEED`` starts every process's chain at random)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, resolve_none_hash_seed

    if hash_algo.startswith("xxhash") and os.environ.get("PYTHONHASHSEED") is None:
        return None
    hash_fn = get_hash_fn_by_name(hash_algo)
    parent = hash_fn(resolve_none_hash_seed(hash_fn))  # vLLM's NONE_HASH: the chain's start
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - tokens_per_hash + 1, tokens_per_hash):
        extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
        parent = hash_block_tokens(hash_fn, parent, tokens[start : start + tokens_per_hash], extra)
        hashes.append(parent)
    return hashes


def held_tokens(layout: TierLayout, hashes: Sequence[bytes]) -> int:
    """Leading tokens whose chunks ``layout``'s tier holds for every KV cache group, looked up in order."""
    held = None
    for group_idx, per_chunk in layout.groups:
        chunks = 0
        for last in range(per_chunk - 1, len(hashes), per_chunk):
            if not os.path.exists(layout.file_name(hashes[last], group_idx)):
                break
            chunks += 1
        tokens = chunks * per_chunk * layout.tokens_per_hash
        held = tokens if held is None else min(held, tokens)
    return held or 0


def _hashable(body: dict[str, Any]) -> bool:
    """Whether the engine core would hash this prompt from its tokens and ``cache_salt`` alone."""
    if "prompt_embeds" in body:
        return False
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(not (isinstance(p, dict) and p.get("type") == "text") for p in content):
            return False
    return True


async def _prompt_tokens(request: Any, body: dict[str, Any]) -> list[int] | Any:
    """The prompt's token ids as vLLM renders and tokenizes it, or vLLM's ``ErrorResponse``: a completion's
    ``prompt``, else a chat's ``messages`` (vLLM's ``/tokenize`` tells its two requests apart the same way)."""
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest, TokenizeCompletionRequest

    if "prompt" in body:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch: the proxy routes it by its first prompt
        if isinstance(prompt, list):
            return [int(t) for t in prompt]  # token ids: vLLM adds nothing to them
        tokenize: Any = TokenizeCompletionRequest.model_validate(
            {**{k: body[k] for k in COMPLETION_FIELDS if k in body}, "prompt": prompt}
        )
    else:
        tokenize = TokenizeChatRequest.model_validate({k: body[k] for k in CHAT_FIELDS if k in body})
    answer = await request.app.state.serving_tokenization.create_tokenize(tokenize, request)
    return answer.tokens if hasattr(answer, "tokens") else answer


def add_route(app: Any, layouts_dir: Path | None, hash_algo: str, block_size: int) -> None:
    """Serve ``wire.TIER_HELD_PATH`` on vLLM's ``app``, from the layouts in ``layouts_dir``, for an engine whose
    blocks hold ``block_size`` tokens."""
    from fastapi.responses import JSONResponse
    from pydantic import ValidationError
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

    layouts: list[TierLayout] = []

    def bad_request(message: str) -> JSONResponse:
        error = ErrorResponse(error=ErrorInfo(message=message, type="BadRequestError", code=400))
        return JSONResponse(error.model_dump(), status_code=400)

    async def tier_held(request: Any) -> JSONResponse:  # a Starlette request: a plain route, no FastAPI parameters
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return bad_request(f"the body is not JSON: {e}")
        if not isinstance(body, dict) or ("prompt" not in body and "messages" not in body):
            return bad_request("the body must be a JSON object: a chat request (messages) or a completion (prompt)")
        nothing = {wire.PROMPT_TOKENS: None, wire.BLOCKS: [], wire.TIERS: {}}
        models = request.app.state.serving_tokenization.models
        if not _hashable(body) or ("model" in body and not models.is_base_model(body["model"])):
            return JSONResponse(nothing)
        try:
            tokens = await _prompt_tokens(request, body)
        except (ValidationError, ValueError, TypeError) as e:
            return bad_request(f"not a chat or completion request: {e}")
        if not isinstance(tokens, list):  # vLLM's error
            return JSONResponse(tokens.model_dump(), status_code=tokens.error.code)
        if not layouts and layouts_dir is not None:
            layouts.extend(await asyncio.to_thread(read_layouts, layouts_dir))
        held: dict[str, int] = {}
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        own = block_hashes(tokens, block_size, hash_algo, salt) or []
        if layouts:

            def look_up() -> dict[str, int]:
                found: dict[str, int] = {}
                chains: dict[int, list[bytes] | None] = {}  # the node and shared tiers hash blocks alike
                for layout in layouts:
                    if layout.tokens_per_hash not in chains:
                        chains[layout.tokens_per_hash] = block_hashes(tokens, layout.tokens_per_hash, hash_algo, salt)
                    if (hashes := chains[layout.tokens_per_hash]) is not None:
                        found[layout.name] = held_tokens(layout, hashes)
                return found

            held = await asyncio.to_thread(look_up)  # stats: milliseconds each on a network filesystem
        blocks = [external_hash(h) for h in own]
        return JSONResponse({wire.PROMPT_TOKENS: len(tokens), wire.BLOCKS: blocks, wire.TIERS: held})

    app.add_route(wire.TIER_HELD_PATH, tier_held, methods=["POST"], include_in_schema=False)
