"""What an engine's log says: the phases of its start (each ended by a line of vLLM's log) and, when it failed,
vLLM's own words about why."""

from __future__ import annotations

import contextlib
import datetime
import re

START_PHASES = (
    ("actor placed", None),
    ("vLLM imported", None),
    ("engine core started", "Initializing a V1 LLM engine"),
    ("weights loaded", "Loading weights took"),
    ("KV cache allocated", "KV cache size:"),
    ("warmed up", "init engine (profile, create kv cache, warmup model) took"),
    ("ready", None),
)
"""The phases of an engine's start, in order, and the line of vLLM's log that ends each one (None: the actor
itself notes it). A phase vLLM does not log (a version that words it otherwise) is left out, never guessed."""


_QUIET_LINE = re.compile(r"\b(INFO|DEBUG)\b")


_ERROR_LINE = re.compile(r"(Error|Exception|error:|Traceback|raise |failed)", re.IGNORECASE)


_LOGGED_AT = re.compile(r"\b(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)\b")


def logged_at(line: str) -> float | None:
    """When vLLM logged ``line`` (its ``MM-DD hh:mm:ss`` stamp, local time, this year), or None (then: now)."""
    if (m := _LOGGED_AT.search(line)) is None:
        return None
    with contextlib.suppress(ValueError):
        month, day, hour, minute, second = map(int, m.groups())
        return datetime.datetime(datetime.date.today().year, month, day, hour, minute, second).timestamp()
    return None


def error_excerpt(log_text: str, exc: BaseException | None = None, max_lines: int = 12) -> str:
    """vLLM's own words about why an engine failed: the last error lines of its log."""
    lines = [line.rstrip() for line in log_text.splitlines()[-400:]]
    picked = [
        line for line in lines if _ERROR_LINE.search(line) and not _QUIET_LINE.search(line) and "Traceback" not in line
    ]
    excerpt = list(dict.fromkeys(picked))[-max_lines:]
    if exc is not None:
        summary = f"{type(exc).__name__}: {exc}"
        if summary not in excerpt:
            excerpt.append(summary)
    return "\n".join(excerpt) or "(the engine's log holds no error line)"
