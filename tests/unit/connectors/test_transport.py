"""The transport seam: the protocol, the choice of a transport per peer pair, and byte-exact reads through the
in-memory transport (the same descriptor arithmetic as NIXL's) across TP sizes, block sizes and layouts,
against the torch reference of ``tests/kv_reference``."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from connectors.block_ranges import plan_peer_ranges
from connectors.errors import TransportError
from connectors.topology import KVTopology, source_ranks
from connectors.transport import NIXL, PREFERENCE, Where, common_transports, where
from connectors.transport.base import KVTransport, Transfer, TransferState
from connectors.transport.fake import InMemoryTransport
from tests.kv_reference import cache_shape, noise_cache, padded, rank_heads, read_tokens, write_tokens

HEAD_DIM = 8
NUM_LAYERS = 2
NUM_BLOCKS = 12
NUM_TOKENS = 3 * 16 + 5
DTYPE = torch.bfloat16


# --------------------------------------------------------------------------- choice


def test_a_pair_gets_the_first_transport_both_offer_in_the_order_for_where_they_are() -> None:
    assert common_transports(("nixl", "cuda-ipc"), ("cuda-ipc", "nixl"), Where.SAME_NODE)[0] == "cuda-ipc"
    assert common_transports(("nixl", "cuda-ipc"), ("nixl",), Where.SAME_NODE)[0] == "nixl"
    assert common_transports(("nixl", "cuda-ipc"), ("nixl", "cuda-ipc"), Where.OTHER_NODE) == ("nixl",)
    assert (
        common_transports(("nixl",), ("verbs",), Where.SAME_NODE) == ()
    )  # the reader's refusal: test_connector_worker
    assert all(NIXL in order for order in PREFERENCE.values())  # CPU engines pair anywhere


def test_where_a_peer_is() -> None:
    assert where("node-a", "node-a") is Where.SAME_NODE
    assert where("node-a", "node-b") is Where.OTHER_NODE
    assert where("", "") is Where.OTHER_NODE  # unknown nodes: assume apart


# --------------------------------------------------------------------------- the in-memory transport


@dataclass(frozen=True)
class Case:
    prefill_tp: int
    decode_tp: int
    heads: int
    prefill_block: int
    decode_block: int

    @property
    def id(self) -> str:
        return f"P{self.prefill_tp}-D{self.decode_tp}-h{self.heads}-b{self.prefill_block}to{self.decode_block}"


CASES = [
    Case(1, 1, 2, 16, 16),
    Case(1, 2, 4, 16, 16),  # each decode rank reads its half of the heads
    Case(2, 1, 4, 8, 16),  # the decode rank joins both prefill ranks' heads, 2 prefill blocks per decode block
    Case(4, 1, 2, 16, 16),  # prefill replicates heads
    Case(2, 4, 2, 16, 16),  # decode replicates heads
]


def topology(tp: int, rank: int, case: Case, block: int, layout: str) -> KVTopology:
    return KVTopology(tp, rank, case.heads, block, layout, HEAD_DIM, str(DTYPE), NUM_LAYERS, "test-model")


def caches(case: Case, tp: int, rank: int, block: int, layout: str, seed: int) -> dict[str, torch.Tensor]:
    heads = len(rank_heads(tp, rank, case.heads))
    shape = cache_shape(layout, NUM_BLOCKS, block, heads, HEAD_DIM)
    generator = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": noise_cache(shape, DTYPE, generator) for i in range(NUM_LAYERS)}


def block_len(cache: torch.Tensor) -> tuple[int, int]:
    """(bytes of one block plane, planes per layer): every layout keeps a block in one plane, blocks outermost."""
    return cache.numel() * cache.element_size() // cache.shape[0], 1


@pytest.mark.parametrize("layout", ["HN2D", "NH2D", "H2ND"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reads_are_byte_exact_across_tp_sizes_block_sizes_and_layouts(case: Case, layout: str) -> None:
    kv = [torch.randn(2, NUM_TOKENS, case.heads, HEAD_DIM, generator=torch.Generator().manual_seed(i)).to(DTYPE)
          for i in range(NUM_LAYERS)]  # fmt: skip
    prefill_ids = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - -(-NUM_TOKENS // case.prefill_block), -1))
    decode_ids = list(range(1, 1 + -(-NUM_TOKENS // case.decode_block)))
    sources = []
    for rank in range(case.prefill_tp):
        layers = caches(case, case.prefill_tp, rank, case.prefill_block, layout, seed=100 + rank)
        heads = rank_heads(case.prefill_tp, rank, case.heads)
        for name, cache in zip(layers, layers.values(), strict=True):
            write_tokens(cache, layout, prefill_ids, kv[int(name.split(".")[1])][:, :, heads])
        transport = InMemoryTransport(f"prefill-r{rank}")
        length, planes = block_len(next(iter(layers.values())))
        regions = transport.register_kv_caches(layers, length, planes_per_layer=planes)
        sources.append((transport, regions, layers))
    for rank in range(case.decode_tp):
        local = topology(case.decode_tp, rank, case, case.decode_block, layout)
        layers = caches(case, case.decode_tp, rank, case.decode_block, layout, seed=200 + rank)
        reader = InMemoryTransport(f"decode-r{rank}")
        assert isinstance(reader, KVTransport)
        length, planes = block_len(next(iter(layers.values())))
        reader.register_kv_caches(layers, length, planes_per_layer=planes)
        for source in source_ranks(local, case.prefill_tp):
            transport, regions, _ = sources[source]
            remote = topology(case.prefill_tp, source, case, case.prefill_block, layout)
            peer = f"prefill-r{source}"
            reader.add_peer(peer, transport.handshake_payload(), regions, plan_peer_ranges(local, remote))
            transfer = reader.read_blocks(peer, decode_ids, prefill_ids, notify=b"read")
            assert isinstance(transfer, Transfer) and transfer.poll() is TransferState.DONE
            assert transfer.num_bytes > 0
            assert transport.poll_notifications() == [(reader.handshake_payload().decode(), b"read")]
        heads = rank_heads(case.decode_tp, rank, case.heads)
        for index, cache in enumerate(layers.values()):
            got = read_tokens(cache, layout, decode_ids, HEAD_DIM)[:, :NUM_TOKENS]
            assert torch.equal(got, padded(kv[index][:, :, heads], NUM_TOKENS)), (rank, index)


def test_a_read_fails_instead_of_hanging_and_bad_input_is_refused() -> None:
    case = CASES[0]
    source, reader = InMemoryTransport("p"), InMemoryTransport("d")
    layers = caches(case, 1, 0, 16, "HN2D", 1)
    length, planes = block_len(next(iter(layers.values())))
    regions = source.register_kv_caches(layers, length, planes_per_layer=planes)
    reader.register_kv_caches(caches(case, 1, 0, 16, "HN2D", 2), length, planes_per_layer=planes)
    with pytest.raises(TransportError, match="unknown peer"):
        reader.read_blocks("p", [0], [0])
    reader.add_peer("p", source.handshake_payload(), regions)
    reader.fail_next = "injected"
    failed = reader.read_blocks("p", [0], [0])
    assert failed.state is TransferState.FAILED and failed.failure_reason == "injected"
    assert reader.read_blocks("p", [0], [0]).state is TransferState.DONE
    with pytest.raises(TransportError, match="already registered"):
        reader.register_kv_caches(layers, length, planes_per_layer=planes)
    source.close()
    gone = reader.read_blocks("p", [0], [0])
    assert gone.state is TransferState.FAILED and "gone" in gone.failure_reason
