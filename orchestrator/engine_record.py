"""What the controller knows of one engine (``EngineRecord``), as ``pdserve status`` lists it, and how long a
failed one waits before it starts again."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "RETRY_FIRST_S",
    "RETRY_MAX_S",
    "RUNNING_STATES",
    "EngineRecord",
    "engine_status",
    "first_line",
    "replica",
    "retry_delay",
    "take_info",
    "warm_since",
]

# A failed engine of a pool below its target starts again after 10 s, then 20, 40 ... at most 5 min apart
# (Kubernetes' back-off for a container that keeps failing); a scale by hand tries it at once.
RETRY_FIRST_S, RETRY_MAX_S = 10.0, 300.0


@dataclass(slots=True)
class EngineRecord:
    engine_id: str
    role: str  # the pool it serves (or, moving, moves into); an engine keeps its id and launch when it moves
    state: str = "pending"  # pending | starting | ready | moving | restarting | draining | failed | stopped
    moving_from: str | None = None  # moving: the pool whose work it finishes before it serves in ``role``
    url: str = ""
    host: str = ""  # the address other hosts reach it at (its node's, resolved by the engine)
    kv_endpoints: tuple[str, ...] = ()  # its connector's side channel, one per TP rank
    pid: int | None = None
    cpu_bind: str | None = None
    load_s: float | None = None
    restarts: int = 0
    failures: int = 0  # starts that failed in a row; reset once it serves
    model: str = ""  # the served name of its model
    error: str | None = None
    log_path: str = ""
    stopping: bool = False  # drained (or never served) and being stopped: no longer taken back
    warm_since: float | None = None  # drained and kept warm (autoscaling.keep_warm_s) since then, monotonic
    warm_cut: asyncio.Event | None = field(default=None, repr=False)  # set: stop it now, its room is needed
    retry_at: float = 0.0  # failed: not started again before this (monotonic)
    asked_at: float | None = None  # when its actor was asked for, or its start (wall clock)
    phases: list[dict[str, Any]] = field(default_factory=list)  # its start's phases: {"phase", "s" since asked}
    handle: Any = field(default=None, repr=False)

    def failed(self, error: str) -> float:
        """It failed with ``error``: the seconds until it may be started again."""
        self.state, self.error, self.failures = "failed", error, self.failures + 1
        delay = retry_delay(self.failures)
        self.retry_at = time.monotonic() + delay
        return delay


_PRIVATE_FIELDS = ("handle", "warm_since", "warm_cut", "retry_at", "asked_at")

RUNNING_STATES = ("ready", "moving", "draining")
"""States in which an engine's vLLM server is up (its ``/metrics`` answers)."""


def retry_delay(failures: int) -> float:
    """Seconds before a failed engine starts again, after ``failures`` failures in a row."""
    return min(RETRY_FIRST_S * 2 ** (failures - 1), RETRY_MAX_S)


def warm_since(record: EngineRecord) -> float:
    return record.warm_since or 0.0


def engine_status(record: EngineRecord, kv_quarantined_blocks: int | None = None) -> dict[str, Any]:
    """An engine as ``pdserve status`` lists it: its record, less what only the controller uses, whether it is
    kept warm, and the KV blocks its /metrics says it quarantined (None: not read)."""
    entry = {f.name: getattr(record, f.name) for f in fields(record) if f.name not in _PRIVATE_FIELDS}
    return entry | {"kept_warm": record.warm_cut is not None, "kv_quarantined_blocks": kv_quarantined_blocks}


def take_phases(record: EngineRecord, info: dict[str, Any]) -> list[dict[str, Any]]:
    """The start's phases an engine reports (``EngineActor.phases``), in seconds since it was asked for; returns
    those that are new."""
    base = record.asked_at or 0.0
    phases = [{"phase": p["phase"], "s": round(max(p["t"] - base, 0.0), 1)} for p in info.get("phases", [])]
    new = phases[len(record.phases) :]
    record.phases = phases
    return new


def take_info(record: EngineRecord, info: dict[str, Any]) -> None:
    """What a ready engine reports about itself: where it serves (it resolved the address on its node)."""
    record.url, record.host, record.kv_endpoints = info["url"], info["host"], tuple(info["kv_endpoints"])
    record.pid, record.cpu_bind, record.load_s = info["pid"], info["cpu_bind"], info["load_s"]
    take_phases(record, info)


def first_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0][:200] if lines else "no error given"


def replica(engine_id: str) -> int:
    return int(engine_id.rsplit("-", 1)[1])
