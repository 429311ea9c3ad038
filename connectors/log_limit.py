"""Log lines that anyone outside the cluster can cause, at most one per kind per interval.

A refused message or parameter set is counted exactly (``connectors.stats``),
but logging each one would let a flood of junk fill an engine's log and its
disk. ``LogLimiter`` writes the first of a kind, then at most one per
``interval_s``, saying how many it left out since the last.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["DEFAULT_INTERVAL_S", "LogLimiter"]

DEFAULT_INTERVAL_S = 10.0


class LogLimiter:
    """Rate-limits log lines by a key (the kind of refusal); thread-safe."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def log(self, level: int, key: str, message: str, *args: object, exc_info: bool = False) -> bool:
        """Log ``message % args`` unless one of ``key`` was logged less than ``interval_s`` ago; True if logged."""
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._interval_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            self._last[key] = now
            left_out = self._suppressed.pop(key, 0)
        if left_out:
            message += " (and %d more like it in the last %.0f s, not logged)"
            args = (*args, left_out, self._interval_s)
        self._logger.log(level, message, *args, exc_info=exc_info)
        return True

    def warning(self, key: str, message: str, *args: object, exc_info: bool = False) -> bool:
        return self.log(logging.WARNING, key, message, *args, exc_info=exc_info)

    def error(self, key: str, message: str, *args: object, exc_info: bool = False) -> bool:
        return self.log(logging.ERROR, key, message, *args, exc_info=exc_info)
