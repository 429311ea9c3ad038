"""NixlKVTransport over CUDA KV caches: VRAM to VRAM between two processes on one GPU.

The checks of ``tests/integration/test_nixl_transport.py`` (which runs them on
CPU caches), imported here and run again with both caches on ``cuda:0``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("nixl", reason="needs NIXL (`pip install -e '.[gpu]'`: nixl and nixl-cu13)")

from tests.integration.test_nixl_transport import (  # noqa: E402, F401 - fixtures and tests run here again
    reader,
    source,
    test_read_blocks_copies_every_layer_into_other_block_ids_and_notifies_source,
    test_read_blocks_rejects_unknown_peers_and_out_of_range_block_ids,
    test_read_from_a_source_that_went_away_fails_within_the_deadline,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def device() -> str:
    return "cuda"


def test_cuda_caches_are_registered_as_vram(reader, source):  # noqa: F811 - the imported fixtures
    transport, _ = reader
    assert transport.kv_regions().mem_type == "VRAM"
    assert (source.regions.mem_type, source.regions.device_id) == ("VRAM", 0)
