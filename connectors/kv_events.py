"""Which blocks an engine's KV cache holds, as vLLM's KV events say, relayed to the proxy over HTTP.

vLLM's scheduler publishes a batch of KV events each step its prefix cache changed (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``; ``--kv-events-config``). The launch binds its publisher and replay
sockets to ``ipc://`` paths in the engine's private run directory (``events_config``): no network address, and
only this host's user can connect. The engine's HTTP server relays them on ``GET wire.KV_EVENTS_PATH?after=N``
(under ``/v1``: vLLM's key check, the cluster's engine key, guards it as it guards the completions routes), one
JSON object a line:

- first ``{"epoch": E, "block_size": B}``: which start of the engine the stream is of
  (``connectors.identity.engine_epoch``) and the tokens a block holds;
- per batch ``{"seq": N, "stored": [h, ...], "removed": [h, ...], "cleared": false}``: the blocks the batch
  stored and removed (``cleared``: it dropped every block first);
- ``{"seq": N, "gap": true}`` where batches before ``N`` were lost (the publisher dropped them or no longer keeps
  them): what the engine holds from before is unknown;
- ``{}`` after ``HEARTBEAT_S`` without a batch, so a reader knows the stream is alive.

A block is named by the low 64 bits of its hash (vLLM's external block hash), as ``held.block_hashes`` names a
prompt's blocks; token ids never leave the engine. Only the engine's own KV cache counts (``medium`` GPU, or
unset on CPU engines), in its first KV cache group; blocks an offloading tier stores are its own. The stream
starts with the batches after ``after`` the publisher still keeps (``REPLAY_BATCHES``), then follows the live
ones; a live batch that skips a number sends the reader back to the replay once before it is called a gap.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

from connectors.identity import engine_epoch
from contract import wire

__all__ = ["HEARTBEAT_S", "REPLAY_BATCHES", "add_route", "batch_line", "events_config", "external_hash"]

HEARTBEAT_S = 5.0
"""A line at least this often, so the reader can tell a quiet engine from a dead connection."""
REPLAY_BATCHES = 4096
"""Batches the publisher keeps for a reader that reconnects (vLLM's ``buffer_steps``)."""
REPLAY_TIMEOUT_S = 5.0
"""How long the replay may take to answer (its publisher serves it between batches, every 0.1 s at least)."""
_HASH_MASK = (1 << 64) - 1
_END_SEQ = -1


def events_config(run_dir: Path) -> dict[str, Any]:
    """``--kv-events-config`` for an engine whose private run directory is ``run_dir``."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{run_dir / 'kv-events.sock'}",
        "replay_endpoint": f"ipc://{run_dir / 'kv-events-replay.sock'}",
        "buffer_steps": REPLAY_BATCHES,
    }


def external_hash(block_hash: bytes | int) -> int:
    """A block hash as vLLM's KV events name it: its low 64 bits."""
    if isinstance(block_hash, int):
        return block_hash & _HASH_MASK
    return int.from_bytes(block_hash, "big") & _HASH_MASK


def _counts(event: Any) -> bool:
    """The engine's own cache, first group: what a request served there finds."""
    medium = getattr(event, "medium", None)
    return medium in (None, "GPU") and getattr(event, "group_idx", None) in (None, 0)


def batch_line(seq: int, events: Iterable[Any]) -> bytes:
    """One batch's line (see the module's docstring) from vLLM's events."""
    stored: list[int] = []
    removed: list[int] = []
    cleared = False
    for event in events:
        name = type(event).__name__
        if name == "AllBlocksCleared":
            cleared, stored, removed = True, [], []
        elif name == "BlockStored" and _counts(event):
            stored += map(external_hash, event.block_hashes)
        elif name == "BlockRemoved" and _counts(event):
            removed += map(external_hash, event.block_hashes)
    return json.dumps({"seq": seq, "stored": stored, "removed": removed, "cleared": cleared}).encode() + b"\n"


def _gap(seq: int) -> bytes:
    return json.dumps({"seq": seq, "gap": True}).encode() + b"\n"


class _Relay:
    """One reader's stream: the replay after ``after``, then the live batches (see the module's docstring)."""

    def __init__(self, config: dict[str, Any], after: int) -> None:
        import msgspec
        import zmq
        import zmq.asyncio
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._context = zmq.asyncio.Context.instance()
        self._zmq = zmq
        self._config, self.last = config, after
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.connect(config["endpoint"])  # before the replay: nothing published meanwhile is missed

    def close(self) -> None:
        self._sub.close(linger=0)

    def _line(self, seq: int, payload: bytes) -> bytes:
        try:
            batch = self._decoder.decode(payload)
        except Exception:  # noqa: BLE001 - a batch this vLLM cannot read: what it said is unknown
            return _gap(seq)
        return batch_line(seq, batch.events)

    async def replay(self) -> AsyncIterator[bytes]:
        """The kept batches after ``last``, in order; a gap line if the first kept one is later than the next."""
        zmq = self._zmq
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self._config["replay_endpoint"])
        try:
            await socket.send_multipart([b"", (self.last + 1).to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(socket.recv_multipart(), REPLAY_TIMEOUT_S)
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == _END_SEQ:
                    return
                if seq <= self.last:
                    continue
                if seq != self.last + 1:
                    yield _gap(seq)
                self.last = seq
                yield self._line(seq, frames[3])
        finally:
            socket.close(linger=0)

    async def live(self) -> AsyncIterator[bytes]:
        """The live batches after ``last``; a number skipped sends back to the replay once, then is a gap."""
        while True:
            try:
                frames = await asyncio.wait_for(self._sub.recv_multipart(), HEARTBEAT_S)
            except TimeoutError:
                yield b"{}\n"
                continue
            if len(frames) != 3:
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq <= self.last:
                continue
            if seq > self.last + 1:
                async for line in self.replay():
                    yield line
                if seq <= self.last:
                    continue
                if seq > self.last + 1:
                    yield _gap(seq)
            self.last = seq
            yield self._line(seq, frames[2])


def add_route(app: Any, config: dict[str, Any], block_size: int) -> None:
    """Serve ``wire.KV_EVENTS_PATH`` on vLLM's ``app``, relaying the publisher ``config`` (``events_config``)."""
    from fastapi.responses import JSONResponse, StreamingResponse

    async def kv_events(request: Any) -> Any:  # a Starlette request: a plain route, no FastAPI parameters
        try:
            after = int(request.query_params.get("after", "-1"))
        except ValueError:
            return JSONResponse({"error": {"message": "after must be an integer", "code": 400}}, status_code=400)
        relay = _Relay(config, max(after, -1))

        async def lines() -> AsyncIterator[bytes]:
            try:
                yield json.dumps({"epoch": engine_epoch(), "block_size": block_size}).encode() + b"\n"
                async for line in relay.replay():
                    yield line
                async for line in relay.live():
                    yield line
            finally:
                relay.close()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    app.add_route(wire.KV_EVENTS_PATH, kv_events, methods=["GET"], include_in_schema=False)
