"""What every command group of the ``pdserve`` command line uses: printing, argument types."""

from __future__ import annotations

import argparse


def say(*parts: object) -> None:
    """Print a line at once (``pdserve up`` and ``scale`` print progress while they wait)."""
    print(*parts, flush=True)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
