"""KV caches on one GPU for the CUDA IPC bench and GPU tests: a spawned *source* process fills caches in vLLM 0.32's
GPU layout HN2D (each layer ``[blocks, heads, block_size, 2 * head_dim]`` bf16, one plane per block) from a seed
and serves them over the transports named; block ids of a given size, picked at random; and a byte-for-byte check
of blocks read against the source's content, regenerated from the seed."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass

import numpy as np
import torch

from connectors.block_ranges import KVRegions
from connectors.transport import make_transport

SOURCE_SEED = 20261127


START_TIMEOUT_S = 120


@dataclass(frozen=True)
class Geometry:
    layers: int = 32
    blocks: int = 1024
    block_size: int = 16
    heads: int = 8
    head_dim: int = 128

    @property
    def shape(self) -> tuple[int, ...]:
        """One layer's cache, HN2D (vLLM 0.32 on GPU, LBHNC): blocks outermost, K and V the halves of the last dim."""
        return (self.blocks, self.heads, self.block_size, 2 * self.head_dim)

    @property
    def plane_bytes(self) -> int:
        """Bytes of one block of one layer, K and V: its one plane."""
        return self.heads * self.block_size * 2 * self.head_dim * 2  # bf16

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, every layer, K and V: what a read moves per block."""
        return self.layers * self.plane_bytes


def layer_cache(geometry: Geometry, layer: int, seed: int | None) -> torch.Tensor:
    """Layer ``layer``'s cache, reproducible from ``seed`` on this GPU (zeros when None)."""
    if seed is None:
        return torch.zeros(geometry.shape, dtype=torch.bfloat16, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(seed + layer)
    return torch.randn(geometry.shape, generator=generator, device="cuda", dtype=torch.bfloat16)


def caches(geometry: Geometry, seed: int | None) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.self_attn": layer_cache(geometry, i, seed) for i in range(geometry.layers)}


def run_source(conn, geometry: Geometry, names: tuple[str, ...], seed: int = SOURCE_SEED, device: int = 0) -> None:
    """Child process: export caches (on GPU ``device``) over each transport, make NIXL progress until told to
    stop."""
    torch.cuda.set_device(device)
    source = caches(geometry, seed)
    torch.cuda.synchronize()
    served = {}
    for name in names:
        transport = make_transport(name, f"prefill-{name}", 60.0)
        transport.register_kv_caches(source, geometry.plane_bytes, planes_per_layer=1)
        served[name] = transport
    conn.send({name: (t.handshake_payload(), t.kv_regions()) for name, t in served.items()})
    while not (conn.poll(0.01) and conn.recv() == "stop"):
        for transport in served.values():
            transport.poll_notifications()
    for transport in served.values():
        transport.close()


@dataclass
class Source:
    process: mp.Process
    conn: object
    offers: dict[str, tuple[bytes, KVRegions]]

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send("stop")
            self.process.join(20)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def start_source(geometry: Geometry, names: tuple[str, ...], seed: int = SOURCE_SEED, device: int = 0) -> Source:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=run_source, args=(child, geometry, names, seed, device), daemon=True)
    process.start()
    if not parent.poll(START_TIMEOUT_S):
        process.kill()
        raise TimeoutError("the source process did not send its payloads")
    return Source(process, parent, parent.recv())


def pick_blocks(geometry: Geometry, size_mib: int, seed: int) -> tuple[list[int], list[int]]:
    """Scattered ``(local, remote)`` block ids whose K and V of every layer make ``size_mib`` MiB."""
    count = size_mib * (1 << 20) // geometry.block_bytes
    if not 1 <= count <= geometry.blocks:
        raise ValueError(
            f"{size_mib} MiB is {count} blocks of {geometry.block_bytes} bytes; the caches hold {geometry.blocks}"
        )
    rng = np.random.default_rng(seed)
    return (
        rng.choice(geometry.blocks, count, replace=False).tolist(),
        rng.choice(geometry.blocks, count, replace=False).tolist(),
    )


def check_blocks(
    geometry: Geometry,
    local: dict[str, torch.Tensor],
    local_ids: list[int],
    remote_ids: list[int],
    seed: int = SOURCE_SEED,
) -> list[str]:
    """Layers whose local blocks differ, in any byte, from the source's blocks (regenerated from ``seed``)."""
    wrong = []
    local_index = torch.tensor(local_ids, device="cuda")
    remote_index = torch.tensor(remote_ids, device="cuda")
    for layer, (name, cache) in enumerate(local.items()):
        expected = layer_cache(geometry, layer, seed).index_select(0, remote_index)
        if not torch.equal(cache.index_select(0, local_index).view(torch.int16), expected.view(torch.int16)):
            wrong.append(name)
        del expected
    return wrong
