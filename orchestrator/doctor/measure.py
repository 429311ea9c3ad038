"""A measurement of the KV path between two processes of this host: 64 MiB of scattered blocks in the spec's
cache layout, read with the connector's own NIXL transport, against a same-process copy of as many bytes.

``measure`` spawns a *source* (it registers its caches, filled from a seed, and serves reads) and a *reader* (it
registers empty caches of the same shape, reads ``count`` random blocks into other random blocks, checks the
first read byte for byte against the seed, then times reads one at a time and a copy of as many bytes within its
own memory). Both run with the environment given (``UCX_TLS`` decides which UCX transports they may use), so one
call measures one path.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

__all__ = ["Geometry", "Measurement", "measure"]

MIB = 2**20
READS = 5


@dataclass(frozen=True)
class Geometry:
    """One engine's KV cache as vLLM 0.32 lays it out: per layer ``[blocks, heads, block_size, 2 * head_dim]``."""

    layers: int
    heads: int
    head_dim: int
    block_size: int
    dtype: str = "bfloat16"

    @property
    def plane_bytes(self) -> int:
        return self.heads * self.block_size * 2 * self.head_dim * _itemsize(self.dtype)

    @property
    def block_bytes(self) -> int:
        """The bytes one block holds over every layer: what a read moves per block."""
        return self.layers * self.plane_bytes


@dataclass(frozen=True)
class Measurement:
    mib: float
    blocks: int
    descriptors: int
    gbps: float
    copy_gbps: float
    """A copy of as many bytes within one process's memory (``Tensor.copy_``): the ceiling."""
    share_of_copy: float
    checked: bool
    """The first read's bytes equal the source's."""

    def to_json(self) -> dict:
        return asdict(self)


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}.get(dtype, 2)


def measure(geometry: Geometry, env: Mapping[str, str], size_mib: int = 64, timeout_s: float = 120) -> Measurement:
    """Measure the path ``env`` leaves UCX (see the module's docstring)."""
    count = max(1, size_mib * MIB // geometry.block_bytes)
    ctx = mp.get_context("spawn")
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # a spawned child starts with this process's environment
    try:
        to_source, source_end = ctx.Pipe()
        to_reader, reader_end = ctx.Pipe()
        source = ctx.Process(target=_source, args=(source_end, geometry, 2 * count), daemon=True)
        reader = ctx.Process(target=_reader, args=(reader_end, geometry, 2 * count, count), daemon=True)
        source.start()
        reader.start()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    try:
        if not to_source.poll(timeout_s):
            raise TimeoutError("the source process did not start")
        to_reader.send(to_source.recv())
        if not to_reader.poll(timeout_s):
            raise TimeoutError("the reader did not finish")
        answer = to_reader.recv()
        if isinstance(answer, BaseException):
            raise answer
        return answer
    finally:
        to_source.send("stop")
        for process in (reader, source):
            process.join(10)
            if process.is_alive():
                process.kill()


def _caches(geometry: Geometry, num_blocks: int, seed: int | None):
    import torch

    dtype = getattr(torch, geometry.dtype)
    shape = (num_blocks, geometry.heads, geometry.block_size, 2 * geometry.head_dim)
    caches = {}
    for layer in range(geometry.layers):
        if seed is None:
            caches[f"layer.{layer}"] = torch.zeros(shape, dtype=dtype)
        else:
            generator = torch.Generator().manual_seed(seed + layer)
            bits = torch.randint(0, 2**15, shape, dtype=torch.int16, generator=generator)
            caches[f"layer.{layer}"] = bits.view(dtype) if dtype.itemsize == 2 else bits.to(dtype)
    return caches


def _source(conn, geometry: Geometry, num_blocks: int) -> None:
    from connectors.transport.nixl import NixlKVTransport

    caches = _caches(geometry, num_blocks, seed=0)
    with NixlKVTransport("doctor-source") as transport:
        regions = transport.register_kv_caches(caches, geometry.plane_bytes)
        conn.send((transport.handshake_payload(), regions))
        conn.recv()


def _reader(conn, geometry: Geometry, num_blocks: int, count: int) -> None:
    try:
        conn.send(_read(conn, geometry, num_blocks, count))
    except BaseException as e:  # noqa: BLE001 - the parent raises it
        conn.send(RuntimeError(f"{type(e).__name__}: {e}"))


def _read(conn, geometry: Geometry, num_blocks: int, count: int) -> Measurement:
    import numpy as np
    import torch

    from connectors.transport.nixl import NixlKVTransport, TransferState

    payload, remote_regions = conn.recv()
    local = _caches(geometry, num_blocks, seed=None)
    expected = _caches(geometry, num_blocks, seed=0)  # what the source holds
    rng = np.random.default_rng(0)
    with NixlKVTransport("doctor-reader", transfer_timeout_s=60) as transport:
        regions = transport.register_kv_caches(local, geometry.plane_bytes)
        transport.add_peer("doctor-source", payload, remote_regions)
        pairs = [(rng.permutation(num_blocks)[:count], rng.permutation(num_blocks)[:count]) for _ in range(READS + 1)]

        def read(local_ids, remote_ids) -> float:
            started = time.perf_counter()
            transfer = transport.read_blocks("doctor-source", local_ids.tolist(), remote_ids.tolist())
            if transfer.wait(0.0002) is not TransferState.DONE:
                raise RuntimeError(f"the READ failed: {transfer.failure_exception()}")
            return time.perf_counter() - started

        read(*pairs[0])  # the first: connection set-up, page faults; then checked
        local_ids, remote_ids = (torch.from_numpy(ids) for ids in pairs[0])
        checked = all(
            torch.equal(local[name][local_ids].view(torch.int16), expected[name][remote_ids].view(torch.int16))
            for name in local
        )
        seconds = statistics.median(read(*pair) for pair in pairs[1:])

        nbytes = count * geometry.block_bytes
        source, target = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)

        def copy() -> float:
            started = time.perf_counter()
            target.copy_(source)
            return time.perf_counter() - started

        copy()
        copy_s = statistics.median(copy() for _ in range(READS))
        descriptors = count * len(regions.region_addrs)
    return Measurement(
        mib=nbytes / MIB,
        blocks=count,
        descriptors=descriptors,
        gbps=nbytes / seconds / 1e9,
        copy_gbps=nbytes / copy_s / 1e9,
        share_of_copy=copy_s / seconds,
        checked=checked,
    )
