"""Test order for the whole suite.

Unit tests run first, while no engine holds the machine's cores (pinned vLLM
CPU engines of a running cluster starve them); then the integration tests that
share one cluster; then those marked ``teardown_check`` (they stop it); then
those marked ``after_cluster``, which start clusters of their own.
"""

from __future__ import annotations

import pytest

ORDER_MARKERS = ("teardown_check", "after_cluster")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        if "tests/unit/" in item.nodeid or item.nodeid.startswith("unit/"):
            return 0
        marked = next((i + 2 for i, name in enumerate(ORDER_MARKERS) if item.get_closest_marker(name)), 1)
        return marked

    items.sort(key=rank)
