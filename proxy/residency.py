"""What each engine's KV cache holds, from the engines' own KV events: the proxy's exact view of their prefix caches.

Every engine relays vLLM's KV events on ``wire.KV_EVENTS_PATH`` (``connectors.kv_events``): the blocks each
step stored and removed, named by the low 64 bits of their hash. ``EventFeeds`` (a task of the app's lifespan)
follows one stream per engine of a model's pool with the cluster's engine key, and ``Residency`` keeps, per
model, which engines hold which blocks. Routing asks ``held`` how many of a prompt's leading blocks
(``wire.BLOCKS``, as an engine hashed them) each engine holds.

What the index knows of an engine is what its stream said since the stream began, so it never claims a block
the engine does not hold once the engine's events have come:

- a stream that begins (a new proxy, an engine that joined) starts from the batches its engine still keeps;
- a stream of another start of the engine (``epoch``: a restart) drops what the index had of the engine first;
- a gap (batches lost) drops the engine's entries, and the index follows on from the batches after it;
- a malformed line, or a stream that breaks or stays silent past ``SILENT_S``, drops the engine's entries too:
  until its stream is back, the engine counts as holding nothing (``held`` leaves it out), and routing falls
  back to what it has without (load, the prefixes it sent);
- an engine that leaves the pool is dropped with its stream.

Memory is bounded by ``max_blocks`` per engine: an engine whose stream claims more (more than any KV cache the
proxy serves holds) is dropped and followed again from its next batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

import orjson

from contract import wire
from proxy.engine_client import EngineClient
from proxy.errors import EngineConnectionError
from proxy.pool import EnginePool, EngineState

__all__ = ["MAX_BLOCKS", "SILENT_S", "EventFeeds", "Residency", "StreamRefused"]

logger = logging.getLogger(__name__)

MAX_BLOCKS = 1 << 22
"""The most blocks one engine may hold in the index (4M: 64 GiB of KV at 16 KiB a block)."""
SILENT_S = 15.0
"""A stream that sends nothing for this long (the engine sends a line every 5 s) is broken."""
RETRY_S = 1.0
"""The wait before following a stream again after it broke."""
REFUSED_RETRY_S = 60.0
"""The wait before asking again an engine that refused the stream (4xx: an engine that does not relay its events,
such as one someone else started, or one that does not take the proxy's key)."""


class StreamRefused(ValueError):
    """The engine answered the stream with a 4xx."""


class Residency:
    """Which engines of one model hold which blocks (see the module's docstring)."""

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._holders: dict[int, set[str]] = {}
        self._blocks: dict[str, set[int]] = {}
        self._live: set[str] = set()
        self._epochs: dict[str, str] = {}

    def following(self) -> bool:
        """Whether the index follows any engine now."""
        return bool(self._live)

    def live(self, engine_id: str) -> bool:
        """Whether the index follows the engine now (its stream is up and whole)."""
        return engine_id in self._live

    def blocks(self, engine_id: str) -> frozenset[int]:
        """The blocks the index says the engine holds."""
        return frozenset(self._blocks.get(engine_id, ()))

    def begin(self, engine_id: str, epoch: str) -> bool:
        """A stream of the engine's start ``epoch`` begins. False when the index followed another start: it has
        dropped what it knew, and the stream must begin again from the first batch the engine keeps."""
        known = self._epochs.get(engine_id)
        self._epochs[engine_id] = epoch
        if known is not None and known != epoch:
            self.forget(engine_id)
            return False
        self._live.add(engine_id)
        return True

    def apply(self, engine_id: str, line: Mapping[str, object]) -> None:
        """One batch of the engine's stream (``connectors.kv_events``), or a gap before one (what the engine held
        is unknown: dropped); ``ValueError`` for a line that is neither."""
        if line.get("gap") is True:
            self._drop(engine_id, self._blocks.pop(engine_id, set()))
            return
        stored, removed, cleared = line.get("stored"), line.get("removed"), line.get("cleared")
        if not (isinstance(stored, list) and isinstance(removed, list) and isinstance(cleared, bool)):
            raise ValueError(f"not a batch: {line!r:.200}")
        held = self._blocks.setdefault(engine_id, set())
        if cleared:
            self._drop(engine_id, held)
            held.clear()
        for block in removed:
            if block in held:
                held.discard(block)
                holders = self._holders[block]
                holders.discard(engine_id)
                if not holders:
                    del self._holders[block]
        for block in stored:
            if type(block) is not int:
                raise ValueError(f"not a block: {block!r:.50}")
            if block not in held:
                held.add(block)
                self._holders.setdefault(block, set()).add(engine_id)
        if len(held) > self.max_blocks:
            raise ValueError(f"more than {self.max_blocks} blocks")

    def forget(self, engine_id: str) -> None:
        """Drop what the index knows of the engine: it counts as holding nothing until its stream is back."""
        self._live.discard(engine_id)
        held = self._blocks.pop(engine_id, set())
        self._drop(engine_id, held)

    def leave(self, engine_id: str) -> None:
        """The engine left the pool."""
        self.forget(engine_id)
        self._epochs.pop(engine_id, None)

    def _drop(self, engine_id: str, blocks: Iterable[int]) -> None:
        for block in blocks:
            holders = self._holders.get(block)
            if holders is not None:
                holders.discard(engine_id)
                if not holders:
                    del self._holders[block]

    def held(self, blocks: Sequence[int]) -> dict[str, int]:
        """How many of ``blocks``' leading blocks each followed engine holds (engines holding none left out)."""
        depth: dict[str, int] = {}
        if not blocks:
            return depth
        holding = self._holders.get(blocks[0], set()) & self._live
        for i, block in enumerate(blocks[1:], 1):
            if not holding:
                break
            still = holding & self._holders.get(block, set())
            for engine_id in holding - still:
                depth[engine_id] = i
            holding = still
        for engine_id in holding:
            depth[engine_id] = len(blocks)
        return depth


class EventFeeds:
    """Follows the KV events of every engine of a model's pool into its ``Residency`` (the app's lifespan)."""

    def __init__(
        self,
        pool: EnginePool,
        residency: Residency,
        client: EngineClient,
        headers: Callable[[], Mapping[str, str]],
        silent_s: float = SILENT_S,
        retry_s: float = RETRY_S,
    ) -> None:
        self.pool, self.residency, self.client, self.headers = pool, residency, client, headers
        self.silent_s, self.retry_s = silent_s, retry_s
        self._feeds: dict[str, asyncio.Task[None]] = {}

    async def run(self) -> None:
        """Follow the pool's engines until cancelled: a stream for each engine, dropped as the engine leaves."""
        changed = asyncio.Event()
        self.pool.watch(changed.set)
        try:
            while True:
                self._reconcile()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), 1.0)
                changed.clear()
        finally:
            self.pool.unwatch(changed.set)
            for task in self._feeds.values():
                task.cancel()
            await asyncio.gather(*self._feeds.values(), return_exceptions=True)

    def _reconcile(self) -> None:
        engines = {e.engine_id: e for e in self.pool.engines()}
        for engine_id in list(self._feeds):
            if engine_id not in engines:
                self._feeds.pop(engine_id).cancel()
                self.residency.leave(engine_id)
        for engine_id, engine in engines.items():
            if engine_id not in self._feeds or self._feeds[engine_id].done():
                name = f"pdserve-kv-events-{engine_id}"
                self._feeds[engine_id] = asyncio.create_task(self._follow(engine), name=name)

    async def _follow(self, engine: EngineState) -> None:
        """The engine's stream, followed again after ``retry_s`` whenever it breaks."""
        after = -1
        while True:
            wait_s = self.retry_s
            try:
                after = await self._stream(engine, after)
            except StreamRefused as e:
                wait_s = REFUSED_RETRY_S
                logger.info("engine %s refused its KV events stream (%s); asking again in %.0f s",
                            engine.engine_id, e, wait_s)  # fmt: skip
            except (EngineConnectionError, TimeoutError, ValueError, OSError) as e:
                logger.info("engine %s: its KV events stream broke (%s); routing without them until it is back",
                            engine.engine_id, e or type(e).__name__)  # fmt: skip
            self.residency.forget(engine.engine_id)
            after = -1  # what it held is forgotten: begin from the first batch the engine keeps
            await asyncio.sleep(wait_s)

    async def _stream(self, engine: EngineState, after: int) -> int:
        """Follow one stream from batch ``after + 1`` until it ends; the last batch applied."""
        url = f"{engine.url}{wire.KV_EVENTS_PATH}?after={after}"
        response = await self.client.get(url, self.silent_s, self.headers())
        try:
            if 400 <= response.status < 500:
                raise StreamRefused(f"HTTP {response.status}")
            if response.status != 200:
                raise ValueError(f"HTTP {response.status}")
            buffer = b""
            began = False
            async for chunk in response.chunks(self.silent_s):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for raw in lines:
                    line = orjson.loads(raw) if raw else {}
                    if not isinstance(line, dict):
                        raise ValueError("a line that is not an object")
                    if not began:
                        epoch = line.get("epoch")
                        if not isinstance(epoch, str):
                            raise ValueError("the stream did not begin with the engine's start")
                        began = True
                        if not self.residency.begin(engine.engine_id, epoch):
                            return -1  # another start of the engine: its numbering begins again
                    elif "seq" in line:
                        self.residency.apply(engine.engine_id, line)
                        after = int(line["seq"])  # type: ignore[call-overload]
            return after
        finally:
            response.release()
