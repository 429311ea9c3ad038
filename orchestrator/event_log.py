"""The controller's events and the snapshot a restarted controller resumes from (``controller.json``).

``EventLog.add(message)`` records an event (``pdserve up`` prints them as
progress, ``pdserve status`` lists them); ``save()`` writes the snapshot. The
snapshot holds what the controller decided (phase, targets, each engine's state
and restarts: ``state()``, the controller's) and the events. It is written on a
change of that state, at once, because a restarted controller acts on it; an
event alone changes nothing a restart needs, so events are written with the
next change, or within ``EVENT_FLUSH_S``, many in one write. The file is
private (0600) and replaced whole, never half written.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from contract.private_files import write_private

logger = logging.getLogger("orchestrator.controller")

SNAPSHOT_NAME = "controller.json"
MAX_EVENTS = 500
EVENT_FLUSH_S = 1.0


class EventLog:
    def __init__(self, log_dir: Path, state: Callable[[], dict[str, Any]]) -> None:
        self.path = log_dir / SNAPSHOT_NAME
        self.state = state
        self.events: list[dict[str, Any]] = []
        self.writes = 0
        self._written: dict[str, Any] | None = None  # the state last written
        self._flush: asyncio.TimerHandle | None = None

    def add(self, message: str) -> None:
        self.events.append({"t": time.time(), "message": message})
        del self.events[:-MAX_EVENTS]
        logger.info("%s", message)
        self.save()

    def save(self) -> None:
        """Write the snapshot now if the state changed; events alone are written within ``EVENT_FLUSH_S``."""
        state = self.state()
        if state != self._written:
            self.write(state)
        elif self._flush is None:
            try:
                self._flush = asyncio.get_running_loop().call_later(EVENT_FLUSH_S, self.write)
            except RuntimeError:  # no loop (the constructor): nothing waits for a timer
                self.write(state)

    def write(self, state: dict[str, Any] | None = None) -> None:
        """Write the snapshot now (``state``: the controller's, if the caller has it already)."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        state = self.state() if state is None else state
        write_private(self.path, json.dumps({**state, "events": self.events}))  # 0600, whole or not at all
        self._written = state
        self.writes += 1

    def read(self) -> dict[str, Any] | None:
        """The snapshot a previous controller wrote, or None; its events become this log's."""
        try:
            snapshot = json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return None
        self.events = snapshot.pop("events", [])
        self._written = snapshot
        return snapshot
