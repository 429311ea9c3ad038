"""Per-actor log files: each engine and the proxy write to a file of their own."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from contract.private_files import make_private_dirs, open_private


def redirect_output(log_path: str | os.PathLike[str]) -> None:
    """Point this process's fds 1 and 2 (and its children's) at ``log_path``.

    vLLM's engine core is a child process that inherits them, so its
    tracebacks land in the engine's own file, where ``pdserve`` reads them.
    """
    path = Path(log_path)
    # Private (0600, directories 0700): a log names requests, engines and hosts. On a node other than
    # the driver's the log directory does not exist yet; its parents made here are private too.
    make_private_dirs(path.parent)
    fd = open_private(path, os.O_WRONLY | os.O_APPEND)
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
