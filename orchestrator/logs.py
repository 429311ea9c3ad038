"""Per-actor log files: each engine and the proxy write to a file of their own."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path


def redirect_output(log_path: str | os.PathLike[str]) -> None:
    """Point this process's fds 1 and 2 (and its children's) at ``log_path``.

    vLLM's engine core is a child process that inherits them, so its
    tracebacks land in the engine's own file, where ``pdserve`` reads them.
    """
    path = Path(log_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # PDSERVE_LOG_LEVEL=debug: our own packages say more (the proxy: each request's phase times)
    level = os.environ.get("PDSERVE_LOG_LEVEL", "INFO").upper()
    for package in ("orchestrator", "proxy", "connectors"):
        logging.getLogger(package).setLevel(level)
