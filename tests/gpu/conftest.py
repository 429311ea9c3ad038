"""GPU-only tests: collected everywhere, run only where CUDA and NIXL are present (skipped elsewhere)."""

from __future__ import annotations

import importlib.util

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reason = None
    if not _cuda_available():
        reason = "needs an NVIDIA GPU (torch.cuda.is_available() is False)"
    elif importlib.util.find_spec("nixl") is None:
        reason = "needs NIXL (`pip install -e '.[gpu]'`: nixl and nixl-cu13)"
    for item in items:
        if "tests/gpu/" in item.nodeid or item.nodeid.startswith("gpu/"):
            item.add_marker(pytest.mark.gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
