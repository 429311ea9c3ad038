"""Test order for the whole suite.

Unit tests (tests/unit, and the lab's in lab/tests) run first, while no engine
holds the machine's cores (pinned vLLM CPU engines of a running cluster starve
them); then the integration tests that share one cluster, grouped by the
connector it runs (each group ends with the tests marked ``teardown_check``,
which stop it); then those marked ``after_cluster``, which start clusters of
their own; last those on the multi-host test bed (fixture ``three_hosts``),
which they share.
"""

from __future__ import annotations

import pytest

CONNECTOR_ORDER = ("vllm-nixl", "pdserve")  # tests.integration.conftest.CONNECTORS


@pytest.hookimpl(trylast=True)  # after pytest's own grouping by fixture parameters
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> tuple[int, int, int]:
        if "tests/unit/" in item.nodeid or item.nodeid.startswith(("unit/", "lab/tests/")):
            return (0, 0, 0)
        if "three_hosts" in getattr(item, "fixturenames", ()):
            return (4, 0, 0)
        if item.get_closest_marker("after_cluster"):
            return (3, 0, 0)
        # The shared cluster runs once per connector: each one's tests, then its teardown check.
        callspec = getattr(item, "callspec", None)
        connector = callspec.params.get("cluster") if callspec is not None else None
        if connector is None:
            return (1, -1, 0)
        return (1, CONNECTOR_ORDER.index(connector), 1 if item.get_closest_marker("teardown_check") else 0)

    items.sort(key=rank)
