"""Where pdserve keeps files on a machine: ``$XDG_CACHE_HOME/pdserve/<part>`` unless overridden."""

from __future__ import annotations

import os
from pathlib import Path


def pdserve_dir(part: str, override_env: str) -> Path:
    """``$override_env`` if set, else ``~/.cache/pdserve/<part>`` (honouring XDG_CACHE_HOME)."""
    override = os.environ.get(override_env)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve" / part
