"""Where pdserve keeps files on a machine: ``$XDG_CACHE_HOME/pdserve/<part>`` unless overridden; and each
engine's temp dir."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path


def pdserve_dir(part: str, override_env: str) -> Path:
    """``$override_env`` if set, else ``~/.cache/pdserve/<part>`` (honouring XDG_CACHE_HOME)."""
    override = os.environ.get(override_env)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve" / part


def compile_cache_dir() -> Path:
    """Where torch's inductor keeps the kernels it compiles for vLLM (the model's, without enforce_eager; the
    sampler helpers', where dynamo is on): ``$TORCHINDUCTOR_CACHE_DIR`` if set, else
    ``~/.cache/pdserve/torchinductor``. Kept across starts; inductor's default is under the temp dir, which
    each engine start empties (``engine_temp_dir``). The cache spares the C++ compile, not dynamo's tracing."""
    return pdserve_dir("torchinductor", "TORCHINDUCTOR_CACHE_DIR")


def engine_temp_dir(log_path: Path) -> Path:
    """The temp dir of the engine that logs to ``log_path`` (its vLLM processes' ``TMPDIR``): named by that
    path, so a restarted engine actor and ``pdserve down`` find the one a crashed engine used; short, under the
    system's temp dir, since vLLM puts Unix sockets in it (their paths have a limit of about 100 bytes)."""
    digest = hashlib.sha1(str(log_path.resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"pdserve-engine-{os.getuid()}-{digest}"


def fresh_temp_dir(temp_dir: Path) -> None:
    """An engine's temp dir, empty (a crashed start's files go) and private; this process's temp dir too."""
    shutil.rmtree(temp_dir, ignore_errors=True)
    temp_dir.mkdir(mode=0o700)
    tempfile.tempdir = str(temp_dir)
