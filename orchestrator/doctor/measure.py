"""A measurement of the KV path between two processes of this host: 64 MiB of scattered blocks in the spec's
cache layout, read with the connector's own transport (NIXL, or CUDA IPC between GPU caches), against a
same-process copy of as many bytes in the same memory.

``measure`` spawns a *source* (it registers its caches, filled from a seed, and serves reads) and a *reader* (it
registers empty caches of the same shape, reads ``count`` random blocks into other random blocks, checks the
first read byte for byte against the seed, then times reads one at a time and a copy of as many bytes within its
own memory). Caches are in CPU memory or on GPU 0 (``memory``). Both run with the environment given (``UCX_TLS``
decides which UCX transports they may use), so one call measures one path.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

__all__ = ["Geometry", "Measurement", "attempt", "measure"]

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


def measure(
    geometry: Geometry,
    env: Mapping[str, str],
    size_mib: int = 64,
    timeout_s: float = 120,
    memory: str = "cpu",
    transport: str = "nixl",
) -> Measurement:
    """Measure the path ``env`` leaves UCX, or CUDA IPC (``transport="cuda-ipc"``, ``memory="cuda"``), between
    caches in ``memory`` (see the module's docstring)."""
    count = max(1, size_mib * MIB // geometry.block_bytes)
    ctx = mp.get_context("spawn")
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # a spawned child starts with this process's environment
    try:
        to_source, source_end = ctx.Pipe()
        to_reader, reader_end = ctx.Pipe()
        how = (memory, transport)
        source = ctx.Process(target=_source, args=(source_end, geometry, 2 * count, how), daemon=True)
        reader = ctx.Process(target=_reader, args=(reader_end, geometry, 2 * count, count, how), daemon=True)
        source.start()
        reader.start()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    try:
        _await(to_source, source, timeout_s, "the source process did not start")
        to_reader.send(to_source.recv())
        _await(to_reader, reader, timeout_s, "the reader did not finish")
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


def _await(conn, process, timeout_s: float, what: str) -> None:
    """Until ``conn`` has a message; ``RuntimeError`` as soon as ``process`` is gone without one."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.1):
        if not process.is_alive():
            raise RuntimeError(f"{what}: its process ended ({process.exitcode})")
        if time.monotonic() > deadline:
            raise TimeoutError(what)


def attempt(
    geometry: Geometry, env: Mapping[str, str], memory: str = "cpu", transport: str = "nixl"
) -> Measurement | str:
    """``measure``, or why it failed."""
    try:
        return measure(geometry, env, memory=memory, transport=transport)
    except (RuntimeError, TimeoutError, OSError) as e:
        return f"{type(e).__name__}: {e}"


def _caches(geometry: Geometry, num_blocks: int, seed: int | None, memory: str = "cpu"):
    import torch

    dtype = getattr(torch, geometry.dtype)
    shape = (num_blocks, geometry.heads, geometry.block_size, 2 * geometry.head_dim)
    caches = {}
    for layer in range(geometry.layers):
        if seed is None:
            caches[f"layer.{layer}"] = torch.zeros(shape, dtype=dtype, device=memory)
        else:
            generator = torch.Generator().manual_seed(seed + layer)
            bits = torch.randint(0, 2**15, shape, dtype=torch.int16, generator=generator)
            caches[f"layer.{layer}"] = (bits.view(dtype) if dtype.itemsize == 2 else bits.to(dtype)).to(memory)
    return caches


def _transport(how: tuple[str, str], name: str, timeout_s: float = 60.0):
    from connectors.transport import make_transport

    return make_transport(how[1], name, timeout_s)


def _source(conn, geometry: Geometry, num_blocks: int, how: tuple[str, str] = ("cpu", "nixl")) -> None:
    caches = _caches(geometry, num_blocks, seed=0, memory=how[0])
    transport = _transport(how, "doctor-source")
    try:
        regions = transport.register_kv_caches(caches, geometry.plane_bytes, planes_per_layer=1)
        conn.send((transport.handshake_payload(), regions))
        while not conn.poll(0.01):  # NIXL's source side completes a READ only while it makes progress
            transport.poll_notifications()
        conn.recv()
    finally:
        transport.close()


def _reader(conn, geometry: Geometry, num_blocks: int, count: int, how: tuple[str, str] = ("cpu", "nixl")) -> None:
    try:
        conn.send(_read(conn, geometry, num_blocks, count, how))
    except BaseException as e:  # noqa: BLE001 - the parent raises it
        conn.send(RuntimeError(f"{type(e).__name__}: {e}"))


def _read(conn, geometry: Geometry, num_blocks: int, count: int, how: tuple[str, str] = ("cpu", "nixl")) -> Measurement:
    import numpy as np
    import torch

    from connectors.transport.base import TransferState

    memory = how[0]
    sync = torch.cuda.synchronize if memory == "cuda" else (lambda: None)
    payload, remote_regions = conn.recv()
    local = _caches(geometry, num_blocks, seed=None, memory=memory)
    expected = _caches(geometry, num_blocks, seed=0, memory=memory)  # what the source holds
    rng = np.random.default_rng(0)
    transport = _transport(how, "doctor-reader")
    try:
        regions = transport.register_kv_caches(local, geometry.plane_bytes, planes_per_layer=1)
        transport.add_peer("doctor-source", payload, remote_regions)
        pairs = [(rng.permutation(num_blocks)[:count], rng.permutation(num_blocks)[:count]) for _ in range(READS + 1)]

        def read(local_ids, remote_ids) -> float:
            started = time.perf_counter()
            transfer = transport.read_blocks("doctor-source", local_ids.tolist(), remote_ids.tolist())
            if transfer.wait() is not TransferState.DONE:
                raise RuntimeError(f"the READ failed: {transfer.failure_reason}")
            return time.perf_counter() - started

        read(*pairs[0])  # the first: connection set-up, page faults, a kernel's compilation; then checked
        local_ids, remote_ids = (torch.from_numpy(ids).to(memory) for ids in pairs[0])
        checked = all(
            torch.equal(local[name][local_ids].view(torch.int16), expected[name][remote_ids].view(torch.int16))
            for name in local
        )
        seconds = statistics.median(read(*pair) for pair in pairs[1:])

        nbytes = count * geometry.block_bytes
        source = torch.ones(nbytes, dtype=torch.uint8, device=memory)
        target = torch.empty(nbytes, dtype=torch.uint8, device=memory)

        def copy() -> float:
            started = time.perf_counter()
            target.copy_(source)
            sync()
            return time.perf_counter() - started

        copy()
        copy_s = statistics.median(copy() for _ in range(READS))
        descriptors = count * len(regions.region_addrs)
    finally:
        transport.close()
    return Measurement(
        mib=nbytes / MIB,
        blocks=count,
        descriptors=descriptors,
        gbps=nbytes / seconds / 1e9,
        copy_gbps=nbytes / copy_s / 1e9,
        share_of_copy=copy_s / seconds,
        checked=checked,
    )
