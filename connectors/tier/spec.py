"""``PdserveTierSpec``: vLLM's tiering offload spec with a worker that runs on CPU engines.

vLLM 0.32's ``CPUOffloadingSpec.get_worker`` refuses any platform but CUDA and
XPU, and its worker copies with a CUDA kernel on CUDA streams. Everything else
of ``TieringOffloadingSpec`` (the scheduler-side managers, the shared host
region, secondary tiers, metrics) is plain Python and is used unchanged; this
module replaces only the worker, whose copies on CPU are plain tensor copies
between the engine's KV pages and the host tier's region, done when submitted.

Loaded by ``OffloadingConnector`` through ``kv_connector_extra_config``::

    {"spec_name": "PdserveTierSpec", "spec_module_path": "connectors.tier.spec", ...}
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch
from typing_extensions import override
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from connectors.tier import REGION_ENV

__all__ = ["CpuTierWorker", "PdserveTierSpec"]

logger = logging.getLogger(__name__)


class _Direction:
    """Copies of one direction between the engine's pages and the host chunks of one worker."""

    def __init__(
        self,
        engine: list[torch.Tensor],
        host: list[torch.Tensor],
        refs: list[list[int]],
        blocks_per_chunk: int,
        to_host: bool,
    ) -> None:
        self.engine = engine  # per tensor: (num_blocks, page) int8
        # per tensor: (num_chunks, blocks_per_chunk, page) int8, a view of the host region
        self.host = [
            h.as_strided((h.shape[0], blocks_per_chunk, e.shape[1]), (h.stride(0), e.shape[1], 1))
            for e, h in zip(engine, host, strict=True)
        ]
        self.refs = refs  # per KV cache group: the tensor indices its layers use
        self.blocks_per_chunk = blocks_per_chunk
        self.to_host = to_host

    def copy(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> int:
        engine_spec, host_spec = (src, dst) if self.to_host else (dst, src)
        assert isinstance(engine_spec, GPULoadStoreSpec)
        assert isinstance(host_spec, BlockIDsLoadStoreSpec)
        engine_ids, chunk_ids = engine_spec.block_ids, host_spec.block_ids
        copied = 0
        e_off = c_off = 0
        for group, (size, first) in enumerate(zip(engine_spec.group_sizes, engine_spec.block_indices, strict=True)):
            if size == 0:
                continue
            skip = first % self.blocks_per_chunk
            n_chunks = -(-(size + skip) // self.blocks_per_chunk)
            blocks = torch.from_numpy(engine_ids[e_off : e_off + size].astype(np.int64))
            chunks = chunk_ids[c_off : c_off + n_chunks].astype(np.int64)
            # host sub-block (chunk, slot) for each engine block, skipping the first chunk's leading slots
            slots = np.arange(skip, skip + size)
            chunk_of = torch.from_numpy(chunks[slots // self.blocks_per_chunk])
            slot_of = torch.from_numpy(slots % self.blocks_per_chunk)
            for t in sorted(set(self.refs[group])):
                if self.to_host:
                    self.host[t][chunk_of, slot_of] = self.engine[t].index_select(0, blocks)
                else:
                    self.engine[t].index_copy_(0, blocks, self.host[t][chunk_of, slot_of])
                copied += size * self.engine[t].shape[1]
            e_off += size
            c_off += n_chunks
        assert e_off == len(engine_ids) and c_off == len(chunk_ids), "block and chunk counts disagree"
        return copied


class CpuTierWorker(OffloadingWorker):
    """Copies between a CPU engine's KV cache and the host tier when a transfer is submitted.

    The engine's step runs in this thread, so a copy made at submission sees the
    KV the model wrote and is complete before the next forward pass reads it.
    ``get_finished`` reports each job once, with its bytes and seconds.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion) -> None:
        self._region = region
        engine: list[torch.Tensor] = []
        host: list[torch.Tensor] = []
        for tensor in kv_caches.tensors:
            if tensor.tensor.device.type != "cpu":
                raise ValueError(f"the CPU tier worker needs the KV cache in host memory, not {tensor.tensor.device}")
            page = tensor.page_size_bytes
            engine.append(tensor.tensor.view(torch.int8).view(-1, page))
            host.append(region.create_next_worker_view(page * blocks_per_chunk))
        refs = [[ref.tensor_idx for ref in group] for group in kv_caches.group_data_refs]
        self._store = _Direction(engine, host, refs, blocks_per_chunk, to_host=True)
        self._load = _Direction(engine, host, refs, blocks_per_chunk, to_host=False)
        self._done: list[TransferResult] = []

    def _run(self, direction: _Direction, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> bool:
        start = time.perf_counter()
        size = direction.copy(src, dst)
        self._done.append(TransferResult(job_id, True, size, time.perf_counter() - start))
        return True

    @override
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._run(self._store, job_id, src_spec, dst_spec)

    @override
    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._run(self._load, job_id, src_spec, dst_spec)

    @override
    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    @override
    def wait(self, job_ids: set[int]) -> None:
        return  # every job finished when it was submitted

    @override
    def shutdown(self) -> None:
        # the views into the region go first, or its mmap cannot close
        self._store = self._load = None  # type: ignore[assignment]
        if self._region is not None:
            self._region.cleanup()
            self._region = None


class PdserveTierSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` whose worker copies on CPU (see the module's docstring)."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        # the host region's name: vLLM's is the engine id, the same in every cluster
        self._engine_id = os.environ.get(REGION_ENV) or self._engine_id

    @override
    def create_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not _on_host(kv_caches):
            return super().create_worker(kv_caches)  # vLLM's worker, on CUDA/XPU
        if self.config.canonical_layout:
            raise ValueError("the CPU tier worker does not write the canonical layout: leave canonical_layout off")
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=0 if self.replicated_layout else self.config.parallel.rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return CpuTierWorker(kv_caches, self.blocks_per_chunk, region)
        except Exception:
            region.cleanup()
            raise

    @override
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not _on_host(kv_caches):
            return super().get_worker(kv_caches)
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)
        return self._worker


def _on_host(kv_caches: CanonicalKVCaches) -> bool:
    return all(t.tensor.device.type == "cpu" for t in kv_caches.tensors)
