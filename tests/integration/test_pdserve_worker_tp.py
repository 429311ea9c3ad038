"""Our connector's workers across TP sizes and block sizes, over real NIXL (UCX) and real side channels.

No engine: ``PdserveWorker``s get a plain stand-in for vLLM's config and
register torch CPU tensors shaped as vLLM's CPU backend shapes its KV cache
(``[num_blocks, kv_heads, block_size, 2 * head_dim]`` per layer). A spawned
*prefill* process runs every rank of the prefill engine (one worker, NIXL
agent and side channel per rank, on ``port + rank``); the test process runs
the decode engine's ranks. The prefill ranks hold the sequence's KV, as the
torch reference (``tests.kv_reference``) lays it out, under a lease; each
decode rank receives the request the way vLLM hands it metadata, handshakes
with the prefill ranks it needs, and READs straight into its cache.

Checked: every decode cache equals the reference (its heads of the sequence
in its blocks, nothing else touched), and every prefill rank ends its lease:
pinned, then READ once each of its readers has read (a rank read by two
decode ranks waits for both), RELEASED for replicas nobody reads.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from connectors.metadata import KVTransferParams, PdserveConnectorMetadata, ReceiveSpec  # noqa: E402
from connectors.worker import PdserveWorker  # noqa: E402
from contract.auth import SECRET_ENV, new_secret  # noqa: E402
from tests.integration.test_nixl_transport import stop  # noqa: E402
from tests.kv_reference import cache_shape, noise_cache, padded, rank_heads, write_tokens  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]  # a safety net: ~20 s per test on an idle host

HEAD_DIM = 32
DTYPE = torch.bfloat16
NUM_LAYERS = 3
NUM_TOKENS = 3 * 32 + 11  # a partly filled last block
NUM_BLOCKS = 16  # per rank's cache; the request uses a few, scattered
SEED = 4321
WAIT_S = 30.0
STARTUP_S = 180.0
PREFILL_ENGINE = "prefill-engine"
PREFILL_REQUEST = "req-on-prefill"


@dataclass(frozen=True)
class Case:
    prefill_tp: int
    decode_tp: int
    num_heads: int
    prefill_block: int
    decode_block: int
    readers: tuple[int, ...]  # decode ranks reading each prefill rank (0: a replica nobody reads)

    @property
    def id(self) -> str:
        tp = f"P{self.prefill_tp}-D{self.decode_tp}"
        return f"{tp}-heads{self.num_heads}-blocks{self.prefill_block}to{self.decode_block}"


CASES = [
    Case(1, 2, 4, 32, 32, (2,)),  # each decode rank reads its half of the one prefill rank's heads
    Case(2, 1, 4, 16, 32, (1, 1)),  # the decode rank joins both prefill ranks' heads; 2 prefill blocks per decode block
    Case(4, 1, 2, 32, 32, (1, 0, 1, 0)),  # prefill replicates heads: ranks 0 and 2 are read, 1 and 3 released
    Case(2, 4, 2, 16, 32, (2, 2)),  # decode replicates heads: each decode rank reads the prefill rank of its head
]


def whole_kv(num_heads: int) -> list[torch.Tensor]:
    """Per layer, the sequence's K and V of every head: ``[2, NUM_TOKENS, heads, HEAD_DIM]``; same in every process."""
    generator = torch.Generator().manual_seed(SEED)
    return [torch.randn(2, NUM_TOKENS, num_heads, HEAD_DIM, generator=generator).to(DTYPE) for _ in range(NUM_LAYERS)]


def prefill_block_ids(case: Case) -> list[int]:
    count = -(-NUM_TOKENS // case.prefill_block)
    return torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(SEED + 1))[:count].tolist()


def decode_block_ids(case: Case) -> list[int]:
    count = -(-NUM_TOKENS // case.decode_block)
    return torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(SEED + 2))[:count].tolist()


def vllm_config(case: Case, role: str, port: int) -> SimpleNamespace:
    """The parts of vLLM's config our worker reads."""
    tp_size, block_size = (
        (case.prefill_tp, case.prefill_block) if role == "prefill" else (case.decode_tp, case.decode_block)
    )
    extra = {
        "side_channel_host": "127.0.0.1",
        "side_channel_port": port,
        "handshake_timeout_s": 20,
        "transfer_timeout_s": 20,
    }
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        model_config=SimpleNamespace(
            get_total_num_kv_heads=lambda: case.num_heads,
            get_head_size=lambda: HEAD_DIM,
            # One model on both sides (its identity enters the compatibility hash).
            model="test/model",
            revision=None,
            hf_config=SimpleNamespace(to_dict=lambda: {"num_kv_heads": case.num_heads}),
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size),
        cache_config=SimpleNamespace(block_size=block_size),
    )


def start_workers(case: Case, role: str, port: int, fill: bool) -> list[tuple[PdserveWorker, list[torch.Tensor]]]:
    """Every rank's worker with registered CPU caches: the reference sequence in them when ``fill``, noise otherwise."""
    tp_size = case.prefill_tp if role == "prefill" else case.decode_tp
    block_size = case.prefill_block if role == "prefill" else case.decode_block
    generator = torch.Generator().manual_seed(SEED + (3 if role == "prefill" else 4))
    whole = whole_kv(case.num_heads)
    block_ids = prefill_block_ids(case)
    workers = []
    for rank in range(tp_size):
        heads = rank_heads(tp_size, rank, case.num_heads)
        shape = cache_shape("H2ND", NUM_BLOCKS, block_size, len(heads), HEAD_DIM)
        caches = [noise_cache(shape, DTYPE, generator) for _ in range(NUM_LAYERS)]
        if fill:
            for layer, cache in enumerate(caches):
                tokens = padded(whole[layer][:, :, heads], len(block_ids) * block_size)
                write_tokens(cache, "H2ND", block_ids, tokens)
        worker = PdserveWorker(vllm_config(case, role, port), f"{role}-engine", SimpleNamespace(num_blocks=NUM_BLOCKS))
        worker.register_kv_caches({f"model.layers.{i}.self_attn": c for i, c in enumerate(caches)}, tp_rank=rank)
        workers.append((worker, caches))
    return workers


def run_prefill(case: Case, port: int, conn) -> None:
    """Child process: every prefill rank holds the request's blocks; reports each rank's lease end to the test."""
    torch.set_num_threads(1)
    workers = start_workers(case, "prefill", port, fill=True)
    hold = PdserveConnectorMetadata(reqs_to_hold={PREFILL_REQUEST: tuple(prefill_block_ids(case))})
    for worker, _ in workers:
        worker.start_load_kv(hold)
    conn.send("ready")
    try:
        while not (conn.poll(0.005) and conn.recv() == "stop"):
            for rank, (worker, _) in enumerate(workers):
                sending, _, _ = worker.transfer_results()
                if sending:
                    stats = worker.take_stats()
                    conn.send((rank, sorted(sending), dict(stats.data["leases"]) if stats else {}))
    finally:
        for worker, _ in workers:
            worker.shutdown()


def free_port_range(count: int) -> int:
    """A base port whose ``count`` ports are free now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count >= 65535:
            continue
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no free port range")


@dataclass
class Prefill:
    process: mp.Process
    conn: object
    port: int
    lease_ends: dict[int, dict[str, int]]

    def poll_lease_ends(self, timeout: float) -> None:
        """Collect the ranks' lease reports that arrive within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.conn.poll(0.01):
                continue
            rank, finished, outcomes = self.conn.recv()
            assert finished == [PREFILL_REQUEST]
            self.lease_ends[rank] = outcomes

    def wait_lease_ends(self, count: int) -> dict[int, dict[str, int]]:
        deadline = time.monotonic() + WAIT_S
        while len(self.lease_ends) < count and time.monotonic() < deadline:
            self.poll_lease_ends(0.05)
        return self.lease_ends


@pytest.fixture(autouse=True)
def cluster_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers (here and in the spawned prefill process) read the cluster's secret from the environment."""
    monkeypatch.setenv(SECRET_ENV, new_secret().reveal())


@pytest.fixture
def start_prefill() -> Iterator:
    started: list[Prefill] = []

    def start(case: Case) -> Prefill:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        port = free_port_range(case.prefill_tp)
        process = ctx.Process(target=run_prefill, args=(case, port, child), daemon=True)
        process.start()
        started.append(Prefill(process, parent, port, {}))
        if not parent.poll(STARTUP_S):  # spawning imports torch and vLLM and starts UCX: slow on a busy machine
            raise TimeoutError("prefill process did not start")
        assert parent.recv() == "ready"
        return started[-1]

    yield start
    for prefill in started:
        stop(prefill, grace_s=10)


@pytest.fixture
def start_decode() -> Iterator:
    started: list[PdserveWorker] = []

    def start(case: Case) -> list[tuple[PdserveWorker, list[torch.Tensor]]]:
        workers = start_workers(case, "decode", free_port_range(case.decode_tp), fill=False)
        started.extend(worker for worker, _ in workers)
        return workers

    yield start
    for worker in started:
        worker.shutdown()


def receive_spec(case: Case, prefill: Prefill) -> ReceiveSpec:
    """What the decode scheduler side hands every decode rank for the request."""
    remote = KVTransferParams(
        remote_engine_id=PREFILL_ENGINE,
        remote_request_id=PREFILL_REQUEST,
        remote_host="127.0.0.1",
        remote_port=prefill.port,
        remote_block_ids=tuple(prefill_block_ids(case)),
        remote_num_tokens=NUM_TOKENS,
        tp_size=case.prefill_tp,
        block_size=case.prefill_block,
    )
    return ReceiveSpec("req-on-decode", tuple(decode_block_ids(case)), remote, remote.remote_block_ids)


def receive(worker: PdserveWorker, spec: ReceiveSpec) -> dict:
    """Hand ``spec`` to one decode rank and step it until the load ends; returns the rank's report."""
    worker.start_load_kv(PdserveConnectorMetadata(reqs_to_receive=[spec]))
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        _, finished, failed = worker.transfer_results()
        if finished:
            assert finished == {spec.request_id}
            report = worker.take_reports().reports[spec.request_id]
            assert not failed, report
            return report
        time.sleep(0.002)
    raise TimeoutError(f"decode rank did not finish loading {spec.request_id}")


def expected_decode_cache(case: Case, rank: int, cache: torch.Tensor, layer: int) -> torch.Tensor:
    """``cache`` as it must be after the load: the rank's heads of the sequence in the request's blocks."""
    expected = cache.clone()
    heads = rank_heads(case.decode_tp, rank, case.num_heads)
    # Remote blocks move whole: the zero padding of the last prefill block comes along.
    tokens = padded(whole_kv(case.num_heads)[layer][:, :, heads], len(prefill_block_ids(case)) * case.prefill_block)
    write_tokens(expected, "H2ND", decode_block_ids(case), tokens)
    return expected


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_decode_ranks_read_their_heads_into_cpu_caches_and_every_prefill_rank_ends_its_lease(
    case: Case, start_prefill, start_decode
) -> None:
    prefill = start_prefill(case)
    decode = start_decode(case)
    spec = receive_spec(case, prefill)
    before = [[cache.clone() for cache in caches] for _, caches in decode]

    reports = [receive(worker, spec) for worker, _ in decode]

    for rank, ((_, caches), originals) in enumerate(zip(decode, before, strict=True)):
        heads = rank_heads(case.decode_tp, rank, case.num_heads)
        for layer, (cache, original) in enumerate(zip(caches, originals, strict=True)):
            expected = expected_decode_cache(case, rank, original, layer)
            assert torch.equal(cache, expected), f"decode rank {rank}, layer {layer}"
        report = reports[rank]
        assert report.source == "transfer"
        num_remote_blocks = len(prefill_block_ids(case))
        assert report.bytes == NUM_LAYERS * num_remote_blocks * len(heads) * 2 * case.prefill_block * HEAD_DIM * 2

    lease_ends = prefill.wait_lease_ends(case.prefill_tp)
    # a rank that is read was pinned first, by each of its readers; a replica nobody reads never is
    assert lease_ends == {
        rank: {"read": 1, "pinned": count} if count else {"released": 1} for rank, count in enumerate(case.readers)
    }


def test_a_prefill_rank_read_by_two_decode_ranks_frees_its_blocks_only_after_both(start_prefill, start_decode) -> None:
    case = CASES[0]
    prefill = start_prefill(case)
    (first, _), (second, _) = start_decode(case)
    spec = receive_spec(case, prefill)

    receive(first, spec)
    prefill.poll_lease_ends(1.0)
    assert prefill.lease_ends == {}, "the prefill rank freed its blocks after one of two reads"

    receive(second, spec)
    assert prefill.wait_lease_ends(1) == {0: {"read": 1, "pinned": 2}}
