"""A READ is drained only when its transport says no byte of it can land; until then its blocks stay out of
vLLM's hands, and a READ that never says so leaves them quarantined for good (docs/architecture.md, "Who owns a
KV block"). NIXL's side runs the real ``NixlKVTransport`` on a stand-in of NIXL's API (``tests/fake_nixl.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from connectors.metadata import KVTransferParams, ReceiveSpec
from connectors.reads import ReadPhase, ReadRecord
from connectors.stats import PdserveWorkerMeta
from connectors.transport.base import TransferState
from connectors.transport.nixl import NixlKVTransport
from tests.fake_nixl import Fabric
from tests.unit.connectors.test_connector_scheduler import FakeRequest, make_scheduler, signed

BLOCK_LEN = 64  # bytes of one block of one layer
LAYERS, BLOCKS = 2, 4


def transport(fabric: Fabric, engine_id: str) -> NixlKVTransport:
    nixl = NixlKVTransport(engine_id, progress="caller", nixl_api=fabric.api())
    caches = {f"layer{i}": torch.zeros(BLOCKS, BLOCK_LEN, dtype=torch.uint8) for i in range(LAYERS)}
    nixl.register_kv_caches(caches, BLOCK_LEN, planes_per_layer=1)
    return nixl


def posted_read(cancels: bool = False):
    fabric = Fabric(BLOCKS, cancels=cancels)
    source, reader = transport(fabric, "prefill"), transport(fabric, "decode")
    reader.add_peer("prefill/rank0", source.handshake_payload(), source.kv_regions())
    fabric.write(source.agent_name, [2, 3], "prompt A")
    read = reader.read_blocks("prefill/rank0", [0, 1], [2, 3], notify=b"A")
    return fabric, source, reader, read


def test_an_aborted_nixl_read_is_drained_only_once_nixl_lets_go_of_it() -> None:
    fabric, source, reader, read = posted_read()
    [xfer] = fabric.in_flight

    read.abort("lease deadline")
    read.poll()

    assert read.state is TransferState.FAILED and not read.drained  # NIXL refused the release: it may land
    fabric.land(xfer)  # ... and it does
    assert not read.drained  # not until the reader sees NIXL let go
    read.poll()
    assert read.drained and xfer.released
    assert fabric.read(reader.agent_name, 0) == "prompt A"


def test_a_read_nixl_cancels_is_drained_at_once() -> None:
    fabric, _, _, read = posted_read(cancels=True)

    read.abort("lease deadline")

    assert read.drained and fabric.in_flight == []


def test_an_aborted_load_is_not_reported_until_its_read_drained() -> None:
    fabric, _, _, read = posted_read()
    [xfer] = fabric.in_flight
    record = ReadRecord(spec(), ("prefill/rank0",), deadline=10.0, drain_timeout_s=5.0, ends_by=12.0)
    record.sources_known()
    record.posted([read])

    record.poll(10.0)  # past the deadline: aborted

    assert record.phase is ReadPhase.ABORTED
    assert record.poll(11.0) is ReadPhase.ABORTED  # NIXL still holds it
    fabric.fail(xfer)
    assert record.poll(11.5) is ReadPhase.DRAINED and not record.quarantined


def test_a_read_that_never_drains_quarantines_its_blocks_by_the_lease_end_plus_margin() -> None:
    _, _, _, read = posted_read()
    record = ReadRecord(spec(), ("prefill/rank0",), deadline=10.0, drain_timeout_s=30.0, ends_by=12.0)
    record.sources_known()
    record.posted([read])
    record.fail("transport", "a sibling READ failed", now=9.0)

    assert record.poll(11.9) is ReadPhase.ABORTED
    assert record.poll(12.0) is ReadPhase.DRAINED and record.quarantined  # not 30 s after the abort


@pytest.mark.parametrize("decode_tp", [1, 2], ids=["one rank", "both ranks report it"])
def test_quarantined_blocks_never_go_back_to_vllms_pool(decode_tp: int) -> None:
    scheduler = make_scheduler()
    request = FakeRequest(kv_transfer_params=signed())
    blocks = [SimpleNamespace(block_id=b, block_hash=None, is_null=False, ref_cnt=1) for b in (3, 4, 5)]
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, SimpleNamespace(blocks=(blocks,)), 300)
    scheduler.build_connector_meta()

    meta = PdserveWorkerMeta(quarantined={request.request_id})
    for _ in range(decode_tp - 1):
        meta.aggregate(PdserveWorkerMeta(quarantined={request.request_id}))
    scheduler.update_connector_output(
        SimpleNamespace(
            kv_connector_worker_meta=meta, failed_recving={request.request_id}, finished_recving={request.request_id}
        )  # fmt: skip
    )
    for block in blocks:  # vLLM frees the request's blocks: a block with a reference left is not free
        block.ref_cnt -= 1

    assert [block.ref_cnt for block in blocks] == [1, 1, 1]
    assert scheduler.quarantined_blocks == 3
    assert scheduler.take_stats().data["quarantined_blocks"] == 3


def spec() -> ReceiveSpec:
    params = KVTransferParams(
        remote_engine_id="prefill", remote_request_id="A", remote_host="127.0.0.1", remote_port=1,
        remote_block_ids=(2, 3), pdserve_expires=12.0,
    )  # fmt: skip
    return ReceiveSpec("A", (0, 1), params, (2, 3))


class Event:
    """A CUDA event as ``IpcRead`` uses it: the copy is over once ``fired``; waiting on it is not allowed here."""

    def __init__(self) -> None:
        self.fired = False

    def query(self) -> bool:
        return self.fired

    def synchronize(self) -> None:
        raise AssertionError("abort waited on the GPU from vLLM's model-runner thread")


def test_an_aborted_cuda_ipc_copy_does_not_wait_on_the_gpu_and_drains_when_its_event_fires() -> None:
    from connectors.transport.cuda_ipc import IpcRead

    event = Event()
    read = IpcRead("prefill/rank0", 64, started=None, event=event, deadline=float("inf"), started_at=0.0)

    read.abort("lease deadline")

    assert read.state is TransferState.FAILED and not read.drained  # the launched copy still runs
    event.fired = True
    assert read.drained
