"""The worker side of our connector across TP sizes, with a fake transport and fake peers (no NIXL, no engine).

``FakeTransport`` stands in for ``NixlKVTransport`` and records what the worker
asks of it; ``FakePrefill`` answers each side-channel port as the prefill rank
``port - PREFILL_PORT`` would. The bytes themselves move in
``tests/integration/test_pdserve_worker_tp.py`` over real NIXL.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from connectors import reader as reader_module  # noqa: E402
from connectors import worker as worker_module  # noqa: E402
from connectors.block_ranges import KVRegions  # noqa: E402
from connectors.cache_layout import describe_kv_cache  # noqa: E402
from connectors.errors import ConnectorError  # noqa: E402
from connectors.handshake import HandshakeResponse  # noqa: E402
from connectors.leases import PinAnswer, read_notification  # noqa: E402
from connectors.metadata import KVTransferParams, PdserveConnectorMetadata, ReceiveSpec  # noqa: E402
from connectors.side_channel import RefusedMessages  # noqa: E402
from connectors.side_messages import report_key  # noqa: E402
from connectors.topology import KVLayout, KVTopology  # noqa: E402
from connectors.transport import CUDA_IPC, NIXL, TRANSPORTS, make_transport, node_identity  # noqa: E402
from connectors.transport.base import KVTransport, TransferState, cache_regions  # noqa: E402
from connectors.transport.fake import InMemoryTransfer  # noqa: E402
from connectors.worker import PdserveWorker, engine_model_identity  # noqa: E402
from contract.auth import KVAuth  # noqa: E402
from contract.kv_report import KVReport  # noqa: E402
from contract.wire import parse_tcp_endpoint  # noqa: E402
from tests.kv_reference import cache_shape, vllm_view  # noqa: E402

HEAD_DIM = 8
NUM_LAYERS = 2
NUM_BLOCKS = 32
PREFILL_PORT = 17600

WorkerFactory = Callable[..., PdserveWorker]


@dataclass
class ScriptedRead(InMemoryTransfer):
    """A READ the test moves by hand; ``landing``: over for the reader, but its bytes may still land."""

    landing: bool = False

    @property
    def drained(self) -> bool:
        return self.state is not TransferState.PENDING and not self.landing


@dataclass
class FakeTransport:
    """Stands in for ``NixlKVTransport``: reads are scripted by the test (states set by hand)."""

    name: str = "nixl"
    notifies_source = True
    refuses: str = ""
    regions: KVRegions | None = None
    peers: dict[str, Any] = field(default_factory=dict)
    reads: list[tuple[str, list[int], list[int], bytes, InMemoryTransfer]] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    notifications: list[tuple[str, bytes]] = field(default_factory=list)
    land_after_s: float | None = None
    """Each READ lands this long after it is posted, as a real one lands meanwhile; None: only when the test
    sets its state."""

    def register_kv_caches(self, caches: dict, block_len_bytes: int, *, planes_per_layer: int) -> KVRegions:
        addresses = (0,) * len(caches) * planes_per_layer
        self.regions = KVRegions(tuple(caches), addresses, NUM_BLOCKS, block_len_bytes, "DRAM", 0)
        return self.regions

    def kv_regions(self) -> KVRegions:
        return self.regions

    def handshake_payload(self) -> bytes:
        return b"agent"

    def cannot_read(self, payload: bytes) -> str | None:
        return self.refuses or None

    def add_peer(self, peer: str, metadata: bytes, regions: KVRegions, ranges: Any) -> str:
        self.peers[peer] = ranges
        return peer

    def remove_peer(self, peer: str) -> None:
        self.peers.pop(peer, None)
        self.removed.append(peer)

    def read_blocks(self, peer: str, local_ids: list[int], remote_ids: list[int], notify: bytes = b"") -> ScriptedRead:
        read = ScriptedRead(peer, len(remote_ids), elapsed_s=0.001)
        self.reads.append((peer, local_ids, remote_ids, notify, read))
        if self.land_after_s is not None:
            threading.Timer(self.land_after_s, setattr, (read, "state", TransferState.DONE)).start()
        return read

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        out, self.notifications = self.notifications, []
        return out

    def close(self) -> None:
        pass


# The model both fake engines serve (not a directory: identified by name and configuration).
FAKE_MODEL = {"model": "fake/model", "revision": None, "hf_config": SimpleNamespace(to_dict=lambda: {"hidden": 64})}
IDENTITY = engine_model_identity(SimpleNamespace(**FAKE_MODEL))


class FakeReleases:
    def __init__(self, engine_id: str):
        self.sent: list[tuple[int, str]] = []
        self.reads: list[tuple[int, str, bytes]] = []

    def release(self, endpoint: str, request_id: str, by: str | None = None) -> None:
        self.sent.append((parse_tcp_endpoint(endpoint)[1], request_id))

    def read_done(self, endpoint: str, reader: str, notification: bytes) -> None:
        self.reads.append((parse_tcp_endpoint(endpoint)[1], reader, notification))

    def close(self) -> None:
        pass


class FakeServer:
    def __init__(self, engine_id: str, host: str, port: int, *args: Any, **kwargs: Any):
        self.endpoint = f"tcp://{host}:{port}"
        self.on_report = kwargs["on_report"]
        self.refused = RefusedMessages()

    def close(self) -> None:
        pass


@dataclass
class FakePrefill:
    """The prefill engine behind ``PREFILL_PORT``: rank r answers on ``PREFILL_PORT + r``, blocks of 16."""

    tp_size: int = 2
    asked: list[int] = field(default_factory=list)
    transports: tuple[str, ...] = (NIXL,)
    node: str = ""
    epoch: str = ""
    pins: list[tuple[int, str, str]] = field(default_factory=list)
    pin_answers: list[PinAnswer] = field(default_factory=list)
    """Answers to the next pins, in order; then OK."""

    def ask_pin(self, endpoint: str, auth: KVAuth, reader: str, request_id: str, epoch: str, timeout_s: float):
        self.pins.append((parse_tcp_endpoint(endpoint)[1], reader, request_id))
        return self.pin_answers.pop(0) if self.pin_answers else PinAnswer.OK

    def request_handshake(
        self, engine_id: str, local: KVTopology, endpoint: str, auth: KVAuth, timeout_s: float
    ) -> HandshakeResponse:
        port = parse_tcp_endpoint(endpoint)[1]
        self.asked.append(port)
        heads = local.total_num_kv_heads
        remote = KVTopology(
            self.tp_size, port - PREFILL_PORT, heads, 16, "H2ND", HEAD_DIM, "bfloat16", NUM_LAYERS, IDENTITY
        )
        return HandshakeResponse(
            engine_id="prefill",
            topology=remote,
            kv_caches_base_addr=(0,) * NUM_LAYERS,
            block_len=remote.block_plane_bytes,
            num_blocks=NUM_BLOCKS,
            transports=self.transports,
            payloads={
                name: b"agent" if name == NIXL else name.encode() for name in self.transports if name in TRANSPORTS
            },
            node=self.node,
            epoch=self.epoch,
        )


@dataclass
class Fakes:
    prefill: FakePrefill
    transports: list[FakeTransport]
    releases: list[FakeReleases]

    gpu_peers: str | None = None
    """None: CUDA IPC is the real one (it stands aside on these CPU caches); else a fake one that serves, and
    refuses every peer for this reason ("" refuses none)."""

    def transport_factory(self, name: str, engine_id: str, transfer_timeout_s: float) -> KVTransport:
        """NIXL is faked; CUDA IPC too when ``gpu_peers`` says so."""
        if name == CUDA_IPC and self.gpu_peers is not None:
            self.transports.append(FakeTransport(name=CUDA_IPC, refuses=self.gpu_peers))
            self.transports[-1].notifies_source = False
            return self.transports[-1]
        if name != NIXL:
            return make_transport(name, engine_id, transfer_timeout_s)
        self.transports.append(FakeTransport())
        return self.transports[-1]


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> Fakes:
    made = Fakes(FakePrefill(), [], [])

    def peers(engine_id: str, auth: KVAuth) -> SimpleNamespace:
        """The reader's side-channel client: the fake prefill answers, releases are recorded."""
        made.releases.append(FakeReleases(engine_id))
        return SimpleNamespace(
            releases=made.releases[-1],
            handshake=lambda local, endpoint, timeout_s: made.prefill.request_handshake(
                engine_id, local, endpoint, auth, timeout_s
            ),
            pin=lambda endpoint, *args: made.prefill.ask_pin(endpoint, auth, *args),
            close=made.releases[-1].close,
        )

    monkeypatch.setattr(worker_module, "SideChannelServer", FakeServer)
    monkeypatch.setattr(reader_module, "PeerClient", peers)
    return made


@pytest.fixture
def make_worker(fakes: Fakes) -> Iterator[Callable[..., PdserveWorker]]:
    """``make_worker(tp_size, tp_rank, heads=4, block_size=32, **connector_options)``: a registered decode worker,
    shut down at the end."""
    workers: list[PdserveWorker] = []

    def make(
        tp_size: int, tp_rank: int, heads: int = 4, block_size: int = 32, mla: bool = False, **options: Any
    ) -> PdserveWorker:
        extra = {"side_channel_host": "127.0.0.1", "side_channel_port": 17700, **options}
        config = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
            model_config=SimpleNamespace(
                get_total_num_kv_heads=lambda: heads, get_head_size=lambda: HEAD_DIM, use_mla=mla, **FAKE_MODEL
            ),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp_size),
            cache_config=SimpleNamespace(block_size=block_size),
        )
        worker = PdserveWorker(config, "decode", SimpleNamespace(num_blocks=NUM_BLOCKS), fakes.transport_factory)
        workers.append(worker)
        shape = (
            (NUM_BLOCKS, 1, block_size, HEAD_DIM)
            if mla
            else (NUM_BLOCKS, max(1, heads // tp_size), block_size, 2 * HEAD_DIM)
        )
        caches = {f"layer.{i}": torch.zeros(shape, dtype=torch.bfloat16) for i in range(NUM_LAYERS)}
        worker.register_kv_caches(caches, tp_rank)
        return worker

    yield make
    for worker in workers:
        worker.shutdown()


def spec(
    request_id: str,
    tp_size: int,
    local_ids: tuple[int, ...],
    remote_ids: tuple[int, ...],
    expires: float | None = None,
    failure: str = "",
    epoch: str | None = None,
) -> ReceiveSpec:
    """A request of 100 tokens on a prefill engine with ``tp_size`` ranks and blocks of 16, whose lease ends at
    ``expires`` (unix s; None: never)."""
    params = KVTransferParams(
        remote_engine_id="prefill",
        remote_request_id=f"p-{request_id}",
        remote_host="127.0.0.1",
        remote_port=PREFILL_PORT,
        remote_block_ids=remote_ids,
        remote_num_tokens=100,
        tp_size=tp_size,
        block_size=16,
        pdserve_expires=expires,
        pdserve_epoch=epoch,
    )
    return ReceiveSpec(request_id, local_ids, params, remote_ids, failure=failure)


def receive(worker: PdserveWorker, transport: FakeTransport, *specs: ReceiveSpec, reads: int) -> None:
    """Hand ``specs`` to the worker and step it until ``reads`` READs are out (handshakes run on threads)."""
    worker.start_load_kv(PdserveConnectorMetadata(reqs_to_receive=list(specs)))
    for _ in range(5000):
        worker.transfer_results()
        if len(transport.reads) >= reads:
            return
        time.sleep(0.001)
    raise AssertionError(f"{len(transport.reads)} READs posted, expected {reads}")


def test_one_decode_rank_reads_each_prefill_rank_and_handshakes_once_per_rank(
    fakes: Fakes, make_worker: WorkerFactory
) -> None:
    worker = make_worker(tp_size=1, tp_rank=0)
    [transport] = fakes.transports
    receive(worker, transport, spec("r1", 2, (5, 9), (1, 2, 3)), reads=2)
    receive(worker, transport, spec("r2", 2, (7,), (4, 6)), reads=4)

    assert sorted(fakes.prefill.asked) == [PREFILL_PORT, PREFILL_PORT + 1]  # once per rank, then cached
    assert set(transport.peers) == {"prefill/rank0", "prefill/rank1"}
    assert [(peer, local, remote, notify) for peer, local, remote, notify, _ in transport.reads[:2]] == [
        # three prefill blocks of 16 tokens fill two decode blocks of 32
        ("prefill/rank0", [5, 9], [1, 2, 3], read_notification("p-r1", 1, "decode/rank0")),
        ("prefill/rank1", [5, 9], [1, 2, 3], read_notification("p-r1", 1, "decode/rank0")),
    ]
    for *_, read in transport.reads:
        read.state = TransferState.DONE
    _, finished, failed = worker.transfer_results()
    assert (finished, failed) == ({"r1", "r2"}, set())
    report = worker.take_reports().reports["r1"]
    assert (report.source, report.remote_ranks, report.bytes) == ("transfer", (0, 1), 6)
    assert report.transport == "nixl"  # both sides offer only NIXL: the choice, said per request
    # the proxy asks the side channel with the prefill's ids (a stream's X-PDServe-KV)
    assert json.loads(worker._server.on_report(report_key("prefill", "p-r1"))) == report.as_dict()
    assert worker._server.on_report(report_key("prefill", "r1")) is None
    assert fakes.releases[0].sent == []


def test_a_failed_read_from_one_rank_aborts_the_others_and_releases_every_rank(
    fakes: Fakes, make_worker: WorkerFactory
) -> None:
    worker = make_worker(tp_size=1, tp_rank=0)
    [transport] = fakes.transports
    receive(worker, transport, spec("r1", 2, (5, 9), (1, 2, 3)), reads=2)
    first, second = (read for *_, read in transport.reads)
    first.state, first.failure_reason = TransferState.FAILED, "peer reset"

    _, finished, failed = worker.transfer_results()

    assert finished == failed == {"r1"}
    assert second.state is TransferState.FAILED  # aborted: nothing may write into blocks vLLM recomputes
    assert worker.get_block_ids_with_load_errors() == {5, 9}
    assert sorted(fakes.releases[0].sent) == [(PREFILL_PORT, "p-r1"), (PREFILL_PORT + 1, "p-r1")]
    assert transport.removed == ["prefill/rank0"]  # that rank may have restarted: handshake again next time
    assert "peer reset" in worker.take_reports().reports["r1"].detail
    assert json.loads(worker._server.on_report(report_key("prefill", "p-r1")))["source"] == "recomputed"


def test_loads_the_scheduler_side_decided_are_answered_to_the_proxy_too(make_worker: WorkerFactory) -> None:
    worker = make_worker(tp_size=1, tp_rank=0)
    key = report_key("prefill", "p-r7")
    worker.start_load_kv(PdserveConnectorMetadata(reports={key: KVReport("local_prefix_cache", bytes=0)}))

    assert json.loads(worker._server.on_report(key)) == {"source": "local_prefix_cache", "bytes": 0}


def test_decode_rank_zero_releases_the_prefill_replicas_nobody_reads(fakes: Fakes, make_worker: WorkerFactory) -> None:
    fakes.prefill.tp_size = 4  # 2 heads on 4 ranks: ranks 1 and 3 hold copies
    worker = make_worker(tp_size=1, tp_rank=0, heads=2)
    [transport] = fakes.transports
    receive(worker, transport, spec("r1", 4, (5,), (1, 2)), reads=2)

    assert sorted(fakes.prefill.asked) == [PREFILL_PORT, PREFILL_PORT + 2]
    assert [peer for peer, *_ in transport.reads] == ["prefill/rank0", "prefill/rank2"]
    assert sorted(fakes.releases[0].sent) == [(PREFILL_PORT + 1, "p-r1"), (PREFILL_PORT + 3, "p-r1")]


def test_two_decode_ranks_tell_the_one_prefill_rank_to_expect_two_reads(
    fakes: Fakes, make_worker: WorkerFactory
) -> None:
    fakes.prefill.tp_size = 1
    for rank in (0, 1):
        worker = make_worker(tp_size=2, tp_rank=rank)
        receive(worker, fakes.transports[rank], spec("r1", 1, (5,), (1, 2)), reads=1)
    assert [transport.reads[0][3] for transport in fakes.transports] == [
        read_notification("p-r1", 2, f"decode/rank{rank}") for rank in (0, 1)
    ]


def worker_with_both_transports(
    fakes: Fakes, make_worker: WorkerFactory, gpu_refusal: str, prefill_node: str
) -> tuple[PdserveWorker, FakeTransport, FakeTransport]:
    """A decode worker with (fake) CUDA IPC and NIXL, reading a TP 1 prefill on ``prefill_node`` that offers
    both; its CUDA IPC refuses every peer for ``gpu_refusal`` ("": none)."""
    fakes.gpu_peers, fakes.prefill.tp_size = gpu_refusal, 1
    fakes.prefill.transports, fakes.prefill.node = (CUDA_IPC, NIXL), prefill_node
    worker = make_worker(tp_size=1, tp_rank=0)
    ipc, nixl = fakes.transports
    return worker, ipc, nixl


def test_a_peer_on_this_node_is_read_by_cuda_ipc_which_tells_the_source_over_the_side_channel(
    fakes: Fakes, make_worker: WorkerFactory
) -> None:
    worker, ipc, nixl = worker_with_both_transports(fakes, make_worker, "", node_identity())
    receive(worker, ipc, spec("r1", 1, (5,), (1, 2)), reads=1)
    ipc.reads[0][-1].state = TransferState.DONE

    assert worker.transfer_results()[1] == {"r1"}
    assert (set(ipc.peers), set(nixl.peers)) == ({"prefill/rank0"}, set())
    assert worker.take_reports().reports["r1"].transport == CUDA_IPC
    # CUDA IPC has no message back: the reader sends the READ notification itself, as this rank
    assert fakes.releases[0].reads == [(PREFILL_PORT, "decode/rank0", read_notification("p-r1", 1, "decode/rank0"))]


def test_a_peer_whose_gpu_this_process_cannot_see_is_read_over_nixl(fakes: Fakes, make_worker: WorkerFactory) -> None:
    worker, ipc, nixl = worker_with_both_transports(fakes, make_worker, "its GPU is not visible", node_identity())
    receive(worker, nixl, spec("r1", 1, (5,), (1, 2)), reads=1)
    nixl.reads[0][-1].state = TransferState.DONE

    assert worker.transfer_results()[1] == {"r1"}
    assert (set(ipc.peers), set(nixl.peers)) == (set(), {"prefill/rank0"})
    assert worker.take_reports().reports["r1"].transport == NIXL
    assert fakes.releases[0].reads == []  # NIXL notifies the source itself


def test_a_peer_on_another_node_is_read_over_nixl_even_when_both_have_cuda_ipc(
    fakes: Fakes, make_worker: WorkerFactory
) -> None:
    worker, ipc, nixl = worker_with_both_transports(fakes, make_worker, "", "another-node")
    receive(worker, nixl, spec("r1", 1, (5,), (1, 2)), reads=1)
    assert (set(ipc.peers), set(nixl.peers)) == (set(), {"prefill/rank0"})


def test_read_notifications_from_the_side_channel_end_leases_as_nixl_ones_do(
    fakes: Fakes, make_worker: WorkerFactory
) -> None:
    worker = make_worker(tp_size=1, tp_rank=0)
    worker.start_load_kv(PdserveConnectorMetadata(reqs_to_hold={"p-r1": (3, 4)}))
    worker._holder.add_notification("decode/rank0", read_notification("p-r1", 2))
    assert worker.transfer_results()[0] == set()  # one of two readers
    worker._holder.add_notification("decode/rank1", read_notification("p-r1", 2))
    assert worker.transfer_results()[0] == {"p-r1"}


def test_a_prefill_rank_counts_reads_that_arrive_before_its_lease(fakes: Fakes, make_worker: WorkerFactory) -> None:
    worker = make_worker(tp_size=1, tp_rank=0)
    [transport] = fakes.transports
    transport.notifications = [("decode-a", read_notification("p-r1", 2)), ("decode-b", read_notification("p-r1", 2))]
    assert worker.transfer_results()[0] == set()  # both reads came first: kept until the hold

    worker.start_load_kv(PdserveConnectorMetadata(reqs_to_hold={"p-r1": (3, 4)}))

    assert worker.transfer_results()[0] == {"p-r1"}


def test_a_prefill_tp_size_that_cannot_pair_fails_the_load_as_incompatible(
    fakes: Fakes, make_worker: WorkerFactory
) -> None:
    worker = make_worker(tp_size=2, tp_rank=0, heads=6)
    worker.start_load_kv(PdserveConnectorMetadata(reqs_to_receive=[spec("r1", 3, (5,), (1, 2))]))

    _, finished, failed = worker.transfer_results()

    assert finished == failed == {"r1"}
    assert worker.take_reports().reports["r1"].reason == "incompatible"
    assert fakes.prefill.asked == []


def test_a_prefill_that_offers_no_transport_we_have_fails_the_load_as_incompatible(
    fakes: Fakes, make_worker: WorkerFactory
) -> None:
    fakes.prefill.tp_size, fakes.prefill.transports = 1, ("verbs",)  # a transport this build has not
    worker = make_worker(tp_size=1, tp_rank=0)
    worker.start_load_kv(PdserveConnectorMetadata(reqs_to_receive=[spec("r1", 1, (5,), (1, 2))]))
    for _ in range(5000):
        _, finished, failed = worker.transfer_results()
        if finished:
            break
        time.sleep(0.001)

    assert finished == failed == {"r1"}
    report = worker.take_reports().reports["r1"]
    assert report.reason == "incompatible"
    assert "no KV transport reaches prefill/rank0 (other-node): we have nixl, it offers verbs" in report.detail


# ---------------------------------------------------------------- cache shapes


@pytest.mark.parametrize(
    ("memory", "permute", "device", "expected"),
    [
        ((10, 2, 16, 2 * HEAD_DIM), None, "cpu", (KVLayout.H2ND, 16)),  # vLLM's CPU cache
        ((10, 2, 16, 2 * HEAD_DIM), None, "cuda", (KVLayout.HN2D, 16)),  # LBHNC
        ((10, 16, 2, 2 * HEAD_DIM), (0, 2, 1, 3), "cuda", (KVLayout.NH2D, 16)),  # LBNHC memory, handed as LBHNC
    ],
)
def test_describe_kv_cache(
    memory: tuple[int, ...], permute: tuple[int, ...] | None, device: str, expected: tuple
) -> None:
    cache = torch.zeros(memory)
    if permute is not None:
        cache = cache.permute(*permute)
    assert describe_kv_cache(cache, 2, HEAD_DIM, device_type=device) == expected


def test_describe_kv_cache_refuses_other_shapes() -> None:
    with pytest.raises(ConnectorError, match=r"unsupported KV cache shape \(10, 3, 16, 16\)"):
        describe_kv_cache(torch.zeros(10, 3, 16, 16), 2, HEAD_DIM)
    with pytest.raises(ConnectorError, match=r"shape \(10, 1, 16, 16\) for an MLA latent of size 8; "):
        describe_kv_cache(torch.zeros(10, 1, 16, 2 * HEAD_DIM), 1, HEAD_DIM, use_mla=True)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize(
    "shape",
    [
        (2, 10, 16, 2, HEAD_DIM),  # K and V planes apart, [2, num_blocks, block_size, heads, head_dim] (older vLLM)
        (10, 2, 16, 2, HEAD_DIM),  # [num_blocks, 2, block_size, heads, head_dim] (older vLLM)
    ],
)
def test_describe_kv_cache_refuses_the_caches_of_older_vllm_naming_the_shape_expected(
    shape: tuple[int, ...], device: str
) -> None:
    with pytest.raises(ConnectorError) as info:
        describe_kv_cache(torch.zeros(shape), 2, HEAD_DIM, device_type=device)
    assert str(info.value) == (
        f"unsupported KV cache shape {shape} for 2 KV heads of size {HEAD_DIM} on this rank; expected "
        f"[num_blocks, 2, block_size, {2 * HEAD_DIM}] (vLLM 0.32's [num_blocks, heads, block_size, 2*head_dim])"
    )


def test_describe_kv_cache_refuses_older_mla_caches() -> None:
    with pytest.raises(ConnectorError) as info:
        describe_kv_cache(torch.zeros(10, 16, HEAD_DIM), 1, HEAD_DIM, use_mla=True)
    assert str(info.value) == (
        f"unsupported KV cache shape (10, 16, {HEAD_DIM}) for an MLA latent of size {HEAD_DIM}; expected "
        f"[num_blocks, 1, block_size, {HEAD_DIM}] (vLLM 0.32)"
    )


@pytest.mark.parametrize("layout", list(KVLayout))
def test_describe_kv_cache_reads_each_layout_as_vllm_hands_it(layout: KVLayout) -> None:
    # vLLM 0.32 hands [num_blocks, heads, block_size, 2 * head_dim] views (MLA: [num_blocks, 1, block_size,
    # latent]); NH2D (LBNHC) memory order shows only in the strides, H2ND only in the device.
    heads = 1 if layout is KVLayout.MLA else 2
    cache = torch.zeros(cache_shape(layout, 10, 16, heads, HEAD_DIM), dtype=torch.float16)
    handed = vllm_view(cache, layout)
    device = "cpu" if layout is KVLayout.H2ND else "cuda"
    described = describe_kv_cache(handed, heads, HEAD_DIM, use_mla=layout is KVLayout.MLA, device_type=device)
    topology = KVTopology(1, 0, heads, 16, layout, HEAD_DIM, "float16", 1)
    assert described == (layout, 16)
    # ... and the transports cut that tensor into the topology's block planes.
    regions = cache_regions({"layer.0": handed}, topology.block_plane_bytes, topology.planes_per_layer, "engine")
    assert regions.num_blocks == 10


def test_an_mla_engine_counts_its_latent_as_one_head_on_every_rank(make_worker: WorkerFactory) -> None:
    """vLLM's MLA cache ([blocks, 1, block_size, latent]) on rank 1 of 2, for a model of 16 KV heads."""
    worker = make_worker(tp_size=2, tp_rank=1, heads=16, mla=True)
    topology = worker._topology
    assert (topology.layout, topology.total_num_kv_heads, topology.num_heads) == (KVLayout.MLA, 1, 1)
    assert topology.block_plane_bytes == 32 * HEAD_DIM * 2  # one bf16 latent per token


def test_the_device_decides_where_k_and_v_are_in_vllm_032_caches() -> None:
    # One shape, two splits: the CPU backend's halves of each head's rows, GPU kernels' halves of the last dim.
    cache = torch.zeros(10, 2, 16, 2 * HEAD_DIM)
    assert describe_kv_cache(cache, 2, HEAD_DIM) == (KVLayout.H2ND, 16)
    assert describe_kv_cache(cache, 2, HEAD_DIM, device_type="cuda") == (KVLayout.HN2D, 16)
    with pytest.raises(ConnectorError, match="KV cache on device 'xpu': the pdserve connector reads caches on cpu"):
        describe_kv_cache(cache, 2, HEAD_DIM, device_type="xpu")


@pytest.mark.parametrize(
    ("memory", "layer_view", "use_mla", "what"),
    [
        ((2, 10, 16, 2 * HEAD_DIM), lambda m: m.transpose(0, 1), False, r"heads outside blocks \(vLLM's LHBNC\)"),
        ((10, 3, 2, 16, 2 * HEAD_DIM), lambda m: m[:, 0], False, "cross-layer BLHNC, BLNHC or BHLNC"),  # BLHNC
        ((10, 3, 16, 2, 2 * HEAD_DIM), lambda m: m[:, 0].transpose(1, 2), False, "cross-layer"),  # BLNHC
        ((10, 2, 3, 16, 2 * HEAD_DIM), lambda m: m[:, :, 0], False, "cross-layer"),  # BHLNC
        ((10, 3, 1, 16, HEAD_DIM), lambda m: m[:, 0], True, "cross-layer"),  # MLA, BLHNC
    ],
)
def test_describe_kv_cache_refuses_layouts_whose_blocks_are_not_outermost(
    memory: tuple[int, ...], layer_view: Callable[[torch.Tensor], torch.Tensor], use_mla: bool, what: str
) -> None:
    cache = layer_view(torch.zeros(memory))
    heads = 1 if use_mla else 2
    with pytest.raises(ConnectorError, match=f"^unsupported KV cache layout: .*{what}.* LBHNC and LBNHC"):
        describe_kv_cache(cache, heads, HEAD_DIM, use_mla=use_mla, device_type="cuda")


# --- a READ never uses blocks that may have been freed (issue 29) --------------------------------------------


def test_params_whose_lease_ends_within_the_margin_are_recomputed_without_a_read(
    fakes: Fakes, make_worker: WorkerFactory
) -> None:
    fakes.prefill.tp_size = 1
    worker = make_worker(tp_size=1, tp_rank=0)
    [transport] = fakes.transports
    # the default margin is 2 s: a lease that ends in 1 s is too short to read in safely
    worker.start_load_kv(PdserveConnectorMetadata(reqs_to_receive=[spec("r1", 1, (5,), (1,), time.time() + 1)]))

    _, finished, failed = worker.transfer_results()

    assert finished == failed == {"r1"}
    assert transport.reads == [] and fakes.prefill.asked == []  # no connection made at all
    assert worker.get_block_ids_with_load_errors() == {5}
    assert worker.take_reports().reports["r1"].reason == "expired"
    assert worker.take_stats().data["failures"] == {"expired": 1}


def reading_under_a_clock(fakes: Fakes, make_worker: WorkerFactory) -> tuple[PdserveWorker, Any, list[float]]:
    """A worker whose reader's wall clock is ``now[0]``, with one READ posted for a lease that ends in 10 s."""
    fakes.prefill.tp_size = 1
    worker = make_worker(tp_size=1, tp_rank=0)
    [transport] = fakes.transports
    now = [time.time()]
    worker._reader._clock = lambda: now[0]
    receive(worker, transport, spec("r1", 1, (5,), (1,), now[0] + 10), reads=1)
    [(*_, read)] = transport.reads
    return worker, read, now


def test_a_read_still_pending_when_the_lease_ends_is_aborted_and_recomputed(
    fakes: Fakes, make_worker: WorkerFactory
) -> None:
    worker, read, now = reading_under_a_clock(fakes, make_worker)

    now[0] += 8.5  # 1.5 s left: inside the 2-s margin, the READ is still under way
    _, finished, failed = worker.transfer_results()

    assert finished == failed == {"r1"}
    assert read.state is TransferState.FAILED  # aborted: nothing may land in blocks vLLM recomputes
    assert "pending" in worker.take_reports().reports["r1"].detail


def test_a_read_seen_done_only_after_the_window_is_not_trusted(fakes: Fakes, make_worker: WorkerFactory) -> None:
    worker, read, now = reading_under_a_clock(fakes, make_worker)
    read.state = TransferState.DONE

    now[0] += 9  # done, but first seen when the blocks may already be another request's
    _, finished, failed = worker.transfer_results()

    assert finished == failed == {"r1"}
    assert worker.get_block_ids_with_load_errors() == {5}
    assert worker.take_reports().reports["r1"].source == "recomputed"


def test_a_read_done_inside_the_window_is_served(fakes: Fakes, make_worker: WorkerFactory) -> None:
    fakes.prefill.tp_size = 1
    worker = make_worker(tp_size=1, tp_rank=0)
    [transport] = fakes.transports
    receive(worker, transport, spec("r1", 1, (5,), (1,), time.time() + 60), reads=1)
    transport.reads[0][-1].state = TransferState.DONE

    _, finished, failed = worker.transfer_results()

    assert (finished, failed) == ({"r1"}, set())
    assert worker.take_reports().reports["r1"].source == "transfer"


def test_a_read_the_scheduler_side_could_not_plan_fails_without_touching_the_engine(
    fakes: Fakes, make_worker: WorkerFactory
) -> None:
    fakes.prefill.tp_size = 1
    worker = make_worker(tp_size=1, tp_rank=0)
    failing = spec("r1", 1, (5,), (1,), failure="ValueError: boom")
    worker.start_load_kv(PdserveConnectorMetadata(reqs_to_receive=[failing]))

    _, finished, failed = worker.transfer_results()

    assert finished == failed == {"r1"}
    assert worker.take_reports().reports["r1"].reason == "internal"


def test_an_exception_while_starting_one_read_fails_only_that_request(
    fakes: Fakes, make_worker: WorkerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    fakes.prefill.tp_size = 1
    worker = make_worker(tp_size=1, tp_rank=0)
    [transport] = fakes.transports
    real_receive = worker._reader.receive

    def receive_or_raise(one: ReceiveSpec) -> None:
        if one.request_id == "bad":
            raise KeyError("a bug of ours")
        real_receive(one)

    monkeypatch.setattr(worker._reader, "receive", receive_or_raise)
    worker.start_load_kv(PdserveConnectorMetadata(reqs_to_receive=[spec("bad", 1, (4,), (1,))]))
    _, finished, failed = worker.transfer_results()
    assert finished == failed == {"bad"}
    assert worker.take_reports().reports["bad"].reason == "internal"

    receive(worker, transport, spec("good", 1, (5,), (2,)), reads=1)  # the next request reads as ever
    transport.reads[0][-1].state = TransferState.DONE
    assert worker.transfer_results()[1:] == ({"good"}, set())


# ---------------------------------------------------------------- pins, drains, starts of the prefill engine


def step_until(worker: PdserveWorker, done: Callable[[tuple[set[str], set[str]]], bool]) -> tuple[set[str], set[str]]:
    """Step the worker until ``done((finished, failed))`` (handshakes and pins run on threads)."""
    for _ in range(5000):
        _, finished, failed = worker.transfer_results()
        if done((finished, failed)):
            return finished, failed
        time.sleep(0.001)
    raise AssertionError("the worker never got there")


def test_a_pin_answered_gone_fails_the_load_without_a_read(fakes: Fakes, make_worker: WorkerFactory) -> None:
    fakes.prefill.tp_size = 1
    fakes.prefill.pin_answers = [PinAnswer.GONE]
    worker = make_worker(tp_size=1, tp_rank=0)
    [transport] = fakes.transports
    worker.start_load_kv(PdserveConnectorMetadata(reqs_to_receive=[spec("r1", 1, (5,), (1,))]))

    finished, failed = step_until(worker, lambda result: bool(result[0]))

    assert finished == failed == {"r1"} and transport.reads == []
    assert worker.take_reports().reports["r1"].reason == "gone"
    assert fakes.releases[0].sent == [(PREFILL_PORT, "p-r1")]  # in our name: ends nothing we did not pin


def test_a_pin_answered_wait_is_asked_again_until_the_lease_is_held(fakes: Fakes, make_worker: WorkerFactory) -> None:
    fakes.prefill.tp_size = 1
    fakes.prefill.pin_answers = [PinAnswer.WAIT, PinAnswer.WAIT]
    worker = make_worker(tp_size=1, tp_rank=0)
    [transport] = fakes.transports
    receive(worker, transport, spec("r1", 1, (5,), (1,)), reads=1)

    assert [request for *_, request in fakes.prefill.pins] == ["p-r1"] * 3


def test_an_aborted_read_is_reported_only_once_it_cannot_land(fakes: Fakes, make_worker: WorkerFactory) -> None:
    """A NIXL READ that could not be cancelled may still write into the local blocks: vLLM gets them back (the
    load reported failed) only when the transport says it drained."""
    worker = make_worker(tp_size=1, tp_rank=0)
    [transport] = fakes.transports
    receive(worker, transport, spec("r1", 2, (5, 9), (1, 2, 3)), reads=2)
    first, second = (read for *_, read in transport.reads)
    second.landing = True  # aborted below, but its bytes may still land
    first.state, first.failure_reason = TransferState.FAILED, "peer reset"

    for _ in range(3):
        assert worker.transfer_results()[1:] == (set(), set())
    assert second.state is TransferState.FAILED and worker.get_block_ids_with_load_errors() == set()
    second.landing = False
    _, finished, failed = worker.transfer_results()
    assert finished == failed == {"r1"} and worker.get_block_ids_with_load_errors() == {5, 9}


def test_parameters_of_a_new_start_handshake_again_and_the_old_mapping_is_dropped(
    fakes: Fakes, make_worker: WorkerFactory
) -> None:
    fakes.prefill.tp_size, fakes.prefill.epoch = 1, "e1"
    worker = make_worker(tp_size=1, tp_rank=0)
    [transport] = fakes.transports
    receive(worker, transport, spec("r1", 1, (5,), (1,), epoch="e1"), reads=1)
    transport.reads[0][-1].state = TransferState.DONE
    assert step_until(worker, lambda result: bool(result[0]))[0] == {"r1"}

    fakes.prefill.epoch = "e2"  # the prefill engine restarted under the same id and port
    receive(worker, transport, spec("r2", 1, (6,), (2,), epoch="e2"), reads=2)

    assert fakes.prefill.asked == [PREFILL_PORT, PREFILL_PORT]  # handshaken again, not taken from the cache
    assert [peer for peer, *_ in transport.reads] == ["prefill/rank0@e1", "prefill/rank0@e2"]
    assert transport.removed == ["prefill/rank0@e1"] and set(transport.peers) == {"prefill/rank0@e2"}


def test_parameters_of_a_start_that_is_over_are_never_read(fakes: Fakes, make_worker: WorkerFactory) -> None:
    fakes.prefill.tp_size, fakes.prefill.epoch = 1, "e2"
    worker = make_worker(tp_size=1, tp_rank=0)
    [transport] = fakes.transports
    worker.start_load_kv(PdserveConnectorMetadata(reqs_to_receive=[spec("r1", 1, (5,), (1,), epoch="e1")]))

    finished, failed = step_until(worker, lambda result: bool(result[0]))

    assert finished == failed == {"r1"} and transport.reads == [] and transport.peers == {}
    assert worker.take_reports().reports["r1"].reason == "gone"


# ---------------------------------------------------------------- the wait after a step (load_wait_s)


def landing_worker(fakes: Fakes, make_worker: WorkerFactory, land_after_s: float | None, **options: Any):
    """A decode worker for one prefill rank whose READs land ``land_after_s`` after they are posted."""
    fakes.prefill.tp_size = 1
    worker = make_worker(tp_size=1, tp_rank=0, **options)
    [transport] = fakes.transports
    transport.land_after_s = land_after_s
    return worker


def test_a_load_that_lands_within_the_wait_is_reported_by_the_step_that_began_it(
    fakes: Fakes, make_worker: WorkerFactory
) -> None:
    """vLLM begins a step's loads after its forward and asks for the results at once: the handshake, the pin and
    a READ of 20 ms all happen inside that one call, so the request joins the next step, not the one after."""
    worker = landing_worker(fakes, make_worker, 0.02, load_wait_s=1.0)
    worker.start_load_kv(PdserveConnectorMetadata(reqs_to_receive=[spec("r1", 1, (5,), (1,))]))

    began = time.monotonic()
    _, finished, failed = worker.transfer_results()

    assert (finished, failed) == ({"r1"}, set())
    assert time.monotonic() - began < 0.5  # it stopped waiting when the READ landed, well inside its 1 s
    assert worker.take_reports().reports["r1"].source == "transfer"


def test_the_wait_is_bounded_and_a_slower_read_is_reported_by_a_later_step(
    fakes: Fakes, make_worker: WorkerFactory
) -> None:
    worker = landing_worker(fakes, make_worker, None, load_wait_s=0.05)
    [transport] = fakes.transports
    worker.start_load_kv(PdserveConnectorMetadata(reqs_to_receive=[spec("r1", 1, (5,), (1,))]))

    began = time.monotonic()
    assert worker.transfer_results()[1:] == (set(), set())
    assert 0.04 < time.monotonic() - began < 0.5
    assert len(transport.reads) == 1  # posted meanwhile; still in flight

    began = time.monotonic()
    assert worker.transfer_results()[1:] == (set(), set())
    assert time.monotonic() - began < 0.04  # a later step waits for nothing it did not begin
    transport.reads[0][-1].state = TransferState.DONE
    assert worker.transfer_results()[1:] == ({"r1"}, set())


def test_with_no_wait_a_load_is_seen_a_step_later(fakes: Fakes, make_worker: WorkerFactory) -> None:
    worker = landing_worker(fakes, make_worker, 0.0, load_wait_s=0)
    worker.start_load_kv(PdserveConnectorMetadata(reqs_to_receive=[spec("r1", 1, (5,), (1,))]))

    assert worker.transfer_results()[1:] == (set(), set())  # its handshake and pin are still out
    assert step_until(worker, lambda result: bool(result[0]))[0] == {"r1"}


def test_a_failed_read_keeps_the_mapping_a_load_waiting_for_its_pin_posts_through(
    fakes: Fakes, make_worker: WorkerFactory
) -> None:
    """A READ from a rank fails while another request from the same rank waits for its pin: that request posts
    through the mapping it was checked with once its pin is granted (it is dropped, and handshaken again, only
    once no load names it), and every later step still reports."""
    fakes.prefill.tp_size = 1
    worker = make_worker(tp_size=1, tp_rank=0)
    [transport] = fakes.transports
    receive(worker, transport, spec("r1", 1, (5,), (1,)), reads=1)
    fakes.prefill.pin_answers = [PinAnswer.WAIT] * 1000  # r2 waits for its lease to be held
    worker.start_load_kv(PdserveConnectorMetadata(reqs_to_receive=[spec("r2", 1, (6,), (2,))]))
    step_until(worker, lambda result: len(fakes.prefill.pins) >= 3)

    first = transport.reads[0][-1]
    first.state, first.failure_reason = TransferState.FAILED, "peer reset"
    assert step_until(worker, lambda result: bool(result[0])) == ({"r1"}, {"r1"})
    assert transport.removed == []  # r2 still names it
    fakes.prefill.pin_answers.clear()  # r2's lease is held now: its pin is answered OK
    step_until(worker, lambda result: len(transport.reads) == 2)
    transport.reads[1][-1].state = TransferState.DONE

    assert step_until(worker, lambda result: bool(result[0])) == ({"r2"}, set())
    worker.transfer_results()
    assert transport.removed == ["prefill/rank0"]  # dropped once nothing used it
    assert worker.take_reports().reports["r2"].source == "transfer"
