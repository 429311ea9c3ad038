"""GPU-only tests: collected everywhere, run only where CUDA is present (skipped elsewhere).

They need no vLLM: ``make test-gpu`` runs them with the machine's own Python
(PyTorch with CUDA, Triton); the NIXL ones also need NIXL (``pip install -e '.[gpu]'``).
"""

from __future__ import annotations

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reason = None if _cuda_available() else "needs an NVIDIA GPU (torch.cuda.is_available() is False)"
    for item in items:
        if "tests/gpu/" in item.nodeid or item.nodeid.startswith("gpu/"):
            item.add_marker(pytest.mark.gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
