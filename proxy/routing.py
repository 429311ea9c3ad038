"""Choosing the engines of a request: a routing policy per pool, and whether to disaggregate at all.

``Router.route(body, api)`` runs once per request. It picks a decode engine
with the decode pool's policy, decides whether the request skips the prefill
leg (decode-only), and if not picks a prefill engine with the prefill pool's
policy, one of ``proxy.policies.REGISTRY`` (``round_robin``, ``least_loaded``,
``prefix_aware``; each says whether it needs the engines' load and the
prompt's prefix hashes, ``prefix_hashes``).

Decode-only: a prompt estimated shorter than ``decode_only_below_tokens``
(its API's ``estimate_tokens``) gains little from a remote prefill and goes to
the decode engine alone; so does, with ``decode_only_if_cached``, a prompt
whose prefix the chosen decode engine was sent recently (it is mostly in its
prefix cache already).

With a shared KV tier (``tier_pools``), what the tier holds of a prompt is asked of
one of the tier's engines before routing (``TierHeld``, from the engine's
``wire.TIER_HELD_PATH``: it tokenizes the prompt as vLLM does and looks the
tier's entries up): every engine of those pools loads that part from the tier.
``decode_only_if_cached`` then sends a prompt the tier holds to a decode engine
alone, and ``prefix_aware`` prefers the engine last sent a prefix only where it
was sent more than the tier holds. Without an answer (no engine, a timeout) the
request is routed as without a tier.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from proxy.apis import GenerationApi
from proxy.apis.base import CHARS_PER_TOKEN
from proxy.config import ProxyConfig
from proxy.policies import PrefixIndex, make_policy
from proxy.pool import EnginePool, EngineState, no_healthy_engine
from proxy.residency import Residency

# --- the router -----------------------------------------------------------------------------


# Why a request is not disaggregated (``Route.reason``; the ``X-PDServe-Path`` header says it).
SHORT_PROMPT, CACHED = "short-prompt", "cached"
NO_PREFILL_ENGINE, NO_DECODE_ENGINE = "no-prefill-engine", "no-decode-engine"
PREFILL_FAILED = "prefill-failed"
DECODE_FAILED = "decode-failed"
"""The decode engine chosen could not be reached, and the prefill's KV was bound to it: another decode engine
computes the prompt."""
"""The prefill leg failed on every engine tried (``ModelFlow``): the decode engine computes the prompt."""
DEGRADED_REASONS = (NO_PREFILL_ENGINE, NO_DECODE_ENGINE, PREFILL_FAILED, DECODE_FAILED)


class TierHeld(NamedTuple):
    """A prompt as an engine answered (``wire.TIER_HELD_PATH``): its length, what the shared KV tier holds of it,
    and its blocks as the engines' KV events name them (``proxy.residency``)."""

    prompt_tokens: int
    held_tokens: int
    blocks: tuple[int, ...] = ()

    @property
    def fraction(self) -> float:
        return min(self.held_tokens / self.prompt_tokens, 1.0) if self.prompt_tokens > 0 else 0.0

    def depth(self, body: dict[str, Any], api: GenerationApi, block_chars: int, prefix_blocks: int) -> int:
        """The leading blocks of the proxy's ``prefix_hashes`` the tier holds: its share of the prompt, in the
        proxy's blocks (the engine counts tokens of the rendered prompt; the proxy hashes characters)."""
        chars = self.fraction * api.estimate_tokens(body) * CHARS_PER_TOKEN
        return min(prefix_blocks, int(chars // block_chars))


class Route(NamedTuple):
    """A request's engines: ``prefill`` None to serve it on ``decode`` alone (then ``reason`` says why;
    with ``NO_DECODE_ENGINE`` the engine that serves it whole is a prefill engine)."""

    prefill: EngineState | None
    decode: EngineState
    prefix: tuple[int, ...]
    reason: str | None = None


class Router:
    """A request's engines: ``route`` picks (prefill or None for decode-only, decode); ``retry`` another."""

    def __init__(self, pool: EnginePool, config: ProxyConfig) -> None:
        self.pool = pool
        self.config = config
        self.routing = routing = config.routing
        self.prefill_policy = make_policy(routing.prefill, routing)
        self.decode_policy = make_policy(routing.decode, routing)
        # What the decode engines were sent, for decode_only_if_cached.
        self.decode_index: PrefixIndex | None = self.decode_policy.index
        if self.decode_index is None and config.decode_only_if_cached:
            self.decode_index = PrefixIndex(routing.prefix_cache_size)
        self._uses_prefix = self.prefill_policy.needs_prefix or self.decode_index is not None
        # What each engine's prefix cache holds, from its KV events (``proxy.residency``): read where the prefix is.
        self.residency = Residency() if self._uses_prefix and routing.kv_events else None
        self._decode_only_below = config.decode_only_below_tokens
        self._cached_fraction = config.decode_only_cached_fraction
        tiers = config.tier_pools
        # Whether routing reads the shared tier: a decision that a tier's contents change.
        self._asks_tier = bool(tiers) and (
            (config.decode_only_if_cached and "decode" in tiers)
            or (self.prefill_policy.needs_prefix and "prefill" in tiers)
            or (self.decode_policy.needs_prefix and "decode" in tiers)
        )
        self._asks_engine = self._asks_tier or self.residency is not None
        self._tier_turn = itertools.count()
        self._any_turn = itertools.count()
        # Engines hold fewer adapters than the cluster serves: an adapter's requests stay on engines of its own.
        self._keeps_adapters = config.max_loras < len(config.adapters)

    def asks_tier(self, body: dict[str, Any], api: GenerationApi) -> bool:
        """Whether ``route`` would use what an engine answers of this prompt (``TierHeld``): routing reads the shared
        tier or the engines' KV events, its API's prompt can be looked up, and the prompt is long enough for one
        prefix block and to be disaggregated."""
        if not self._asks_engine or not api.tier_lookup:
            return False
        tokens = api.estimate_tokens(body)
        return tokens * CHARS_PER_TOKEN >= self.routing.prefix_block_chars and tokens >= self._decode_only_below

    def tier_engine(self) -> EngineState | None:
        """The engine to ask about a prompt: a ready engine of the tier's pools (without a tier: of either pool), in
        turn."""
        return self._in_turn(self.config.tier_pools or ("decode", "prefill"), self._tier_turn)

    def route(self, body: dict[str, Any], api: GenerationApi, held: TierHeld | None = None) -> Route:
        """The request's engines (``Route``). With ``degrade``, a pool without a ready engine is skipped:
        the other pool's engine serves the request alone; ``NoHealthyEngine`` only when neither can.
        ``held``: what the shared tier holds of the prompt (``asks_tier``), if known."""
        prefix = (
            prefix_hashes(body, api, self.routing.prefix_block_chars, self.routing.prefix_max_blocks)
            if self._uses_prefix
            else ()
        )
        in_tier = held.depth(body, api, self.routing.prefix_block_chars, len(prefix)) if held and prefix else 0
        resident = self._resident(held, len(prefix))
        tiers = self.config.tier_pools
        adapter = body["model"] if self._keeps_adapters and body["model"] in self.config.adapters else None
        engines = self._holding(self.pool.ready("decode"), adapter)
        if not engines:
            if not self.config.degrade:
                raise no_healthy_engine("decode")
            return Route(None, self.prefill_policy.pick(self._ready("prefill"), prefix), prefix, NO_DECODE_ENGINE)
        if self.decode_index is None:
            decode = self.decode_policy.pick(engines, prefix)
        else:
            decode = self.decode_policy.choose(engines, prefix, in_tier if "decode" in tiers else 0, resident)
            if prefix:
                if resident is not None:
                    sent = resident.get(decode.engine_id, 0)
                else:
                    sent = self.decode_index.blocks_sent(prefix, decode.engine_id)
                self.decode_index.record(prefix, decode.engine_id)
                stored = held.fraction if held is not None and "decode" in tiers else 0.0
                cached = sent >= self._cached_fraction * len(prefix) or stored >= self._cached_fraction
                if self.config.decode_only_if_cached and cached:
                    return Route(None, decode, prefix, CACHED)
        if self._decode_only_below and api.estimate_tokens(body) < self._decode_only_below:
            return Route(None, decode, prefix, SHORT_PROMPT)
        engines = self._holding(self.pool.ready("prefill"), adapter)
        if engines:
            shared = in_tier if "prefill" in tiers else 0
            return Route(self.prefill_policy.pick(engines, prefix, shared, resident), decode, prefix)
        if not self.config.degrade:
            raise no_healthy_engine("prefill")
        return Route(None, decode, prefix, NO_PREFILL_ENGINE)

    def _resident(self, held: TierHeld | None, prefix_blocks: int) -> dict[str, int] | None:
        """How many of the prompt's leading prefix blocks each engine's prefix cache holds, as its KV events say
        (the engine's blocks in proportion: the proxy hashes characters, the engine tokens); None where the index
        follows no engine, or the engine that was asked did not hash the prompt."""
        if self.residency is None or held is None or not held.blocks or not self.residency.following():
            return None
        count = len(held.blocks)
        return {e: depth * prefix_blocks // count for e, depth in self.residency.held(held.blocks).items()}

    def _holding(self, engines: tuple[EngineState, ...], adapter: str | None) -> tuple[EngineState, ...]:
        """The engines that serve ``adapter``'s requests (all, for the base model): ``adapter_engines``."""
        if adapter is None:
            return engines
        return adapter_engines(engines, adapter, self.config.max_loras, len(self.config.adapters))

    def retry(self, role: str, prefix: tuple[int, ...], tried: Sequence[EngineState]) -> EngineState | None:
        """A ready engine of ``role``'s pool not in ``tried`` (chosen by the pool's policy), or None."""
        engines = tuple(e for e in self.pool.ready(role) if e not in tried)
        policy = self.prefill_policy if role == "prefill" else self.decode_policy
        return policy.pick(engines, prefix) if engines else None

    def any_engine(self) -> EngineState:
        """A ready engine of either pool, in turn (a request no KV moves for: a relay API, ``proxy.apis.relays``)."""
        engine = self._in_turn(("decode", "prefill"), self._any_turn)
        if engine is None:
            raise no_healthy_engine("prefill or decode")
        return engine

    def _in_turn(self, roles: Sequence[str], turn: itertools.count) -> EngineState | None:
        """The next of the ready engines of ``roles``' pools by ``turn`` (None when there is none)."""
        engines = [e for role in roles for e in self.pool.ready(role)]
        return engines[next(turn) % len(engines)] if engines else None

    def _ready(self, role: str) -> tuple[EngineState, ...]:
        engines = self.pool.ready(role)
        if not engines:
            raise no_healthy_engine(role)
        return engines


def adapter_engines(
    engines: tuple[EngineState, ...], adapter: str, max_loras: int, adapters: int
) -> tuple[EngineState, ...]:
    """The engines of a pool that serve one LoRA adapter's requests when each holds ``max_loras`` of ``adapters``:
    its share of the pool (``len(engines) * max_loras / adapters``, at least one), by rendezvous hashing of
    (adapter, engine id). An adapter keeps its engines while the pool stays, and only the adapters of an engine
    that joins or leaves move, so an engine rarely swaps an adapter in."""
    share = max(1, math.ceil(len(engines) * max_loras / adapters))
    if share >= len(engines):
        return engines

    def rank(engine: EngineState) -> bytes:
        return hashlib.blake2b(f"{adapter}\0{engine.engine_id}".encode(), digest_size=8).digest()

    return tuple(sorted(engines, key=rank, reverse=True)[:share])


# --- what a prompt is -----------------------------------------------------------------------


def prefix_hashes(body: dict[str, Any], api: GenerationApi, block_chars: int, max_blocks: int) -> tuple[int, ...]:
    """Chained hashes of the prompt's first full blocks: hash *i* stands for blocks 0..*i*.

    Text blocks are ``block_chars`` characters; token-id prompts are cut into blocks
    of ``block_chars / 4`` tokens. The prompt is its API's ``prefix_text`` (a
    chat: its messages' roles and contents in order; a batch of prompts: its
    first). A partial last block is left out, as
    vLLM caches only full blocks. Python's ``hash`` is salted per process, which is
    fine: the index lives in the process.
    """
    prompt = api.prefix_text(body, block_chars * max_blocks)
    size = block_chars if isinstance(prompt, str) else max(1, block_chars // CHARS_PER_TOKEN)
    count = min(len(prompt) // size, max_blocks)
    hashes = []
    chained = hash(body.get("model"))  # a prefix cached for one adapter (or model) is not another's
    for start in range(0, count * size, size):
        block = prompt[start : start + size]
        chained = hash((chained, block if isinstance(block, str) else tuple(block)))
        hashes.append(chained)
    return tuple(hashes)
