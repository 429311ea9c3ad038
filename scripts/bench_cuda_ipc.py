"""KV reads by CUDA IPC between two processes on one GPU, against a same-process device copy and NIXL over VRAM.

A spawned *source* process fills caches in vLLM 0.32's GPU layout HN2D
(``--layers`` x ``[--blocks, heads, block_size, 2 * head_dim]`` bf16 on
``cuda:0``, one plane per block and layer) from a seed and registers them with
``CudaIpcTransport`` (and ``NixlKVTransport`` when NIXL imports). This process
registers caches of its own and, for each size in ``--sizes-mib``, reads that
many bytes of randomly chosen source blocks into other random local blocks:

* ``cuda-ipc (triton)``: ``read_blocks`` + ``wait``, the one-launch gather;
* ``cuda-ipc (torch)``: the same with the stock gather (one ``index_copy_`` per pair of regions);
* ``device copy``: ``Tensor.copy_`` of one contiguous buffer of the same bytes, in this process: the reference;
* ``nixl``: ``NixlKVTransport.read_blocks`` + ``wait`` of the same blocks (UCX picks the path).

Every way's first read is checked byte for byte against the source's content
(regenerated here from the seed). Each is timed two ways after a warm-up, in
GB/s (bytes moved, counted once) and as a ratio to the device copy timed the
same way in the same run: *one at a time* (the median of ``--iters`` reads,
each waited for: host work and launch included, a lone request's cost) and
*pipelined* (``--iters`` reads posted back to back, then waited for: the
throughput of a busy engine). Exit status 1 if any check fails.

Run from the repository root on a GPU machine: ``python scripts/bench_cuda_ipc.py [--json FILE]``
(``make test-gpu`` runs it after the GPU tests).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

# A script, not a package module: make ``connectors`` importable when run by path (here and in the spawned source).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connectors.transport import CUDA_IPC, NIXL, make_transport  # noqa: E402
from connectors.transport.base import TransferState  # noqa: E402
from connectors.transport.cuda_ipc import CudaIpcTransport  # noqa: E402
from testlib.cuda_ipc_blocks import (  # noqa: E402
    SOURCE_SEED,
    Geometry,
    Source,
    caches,
    check_blocks,
    pick_blocks,
    start_source,
)

GB = 1e9
MODES = ("one at a time", "pipelined")
WAYS = ("cuda-ipc (triton)", "cuda-ipc (triton, torch calls)", "cuda-ipc (torch)", "nixl")
# (words per program, warps, 16-byte hints, compiled kernel launched directly, where the offsets are read)
SWEEP = ((2048, 4, True, True, "device"), (2048, 4, True, True, "host"), (2048, 4, False, True, "device"),
         (2048, 4, True, False, "device"), (1024, 4, True, True, "device"), (4096, 8, True, True, "device"),
         (1024, 2, True, True, "device"), (512, 4, True, True, "device"))  # fmt: skip


def one_at_a_time(step: Callable[[], None], iters: int) -> float:
    """Median seconds of ``step`` (which waits for its own end) after one warm-up."""
    step()
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def pipelined(post: Callable[[], Callable[[], None]], iters: int) -> float:
    """Seconds per step of ``iters`` steps posted back to back (``post`` returns the step's wait), then waited for."""
    post()()
    started = time.perf_counter()
    waits = [post() for _ in range(iters)]
    for wait in waits:
        wait()
    return (time.perf_counter() - started) / iters


def read_post(transport, peer: str, local_ids: list[int], remote_ids: list[int]) -> Callable[[], Callable[[], None]]:
    def post() -> Callable[[], None]:
        read = transport.read_blocks(peer, local_ids, remote_ids)

        def wait() -> None:
            if read.wait() is not TransferState.DONE:
                raise RuntimeError(f"read from {peer} failed: {read.failure_reason}")

        return wait

    return post


def copy_post(num_bytes: int) -> Callable[[], Callable[[], None]]:
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    def post() -> Callable[[], None]:
        dst.copy_(src)
        return torch.cuda.synchronize

    return post


def phases(
    transport: CudaIpcTransport, way: str, local_ids: list[int], remote_ids: list[int], iters: int
) -> dict[str, float]:
    """Where a read's time goes (medians, us): planning and launching it on the host, and the gather on the GPU.
    The GPU is kept busy while the host launches (``torch.cuda._sleep``), so the GPU time is the copy's alone."""
    host, gpu = [], []
    for _ in range(iters):
        torch.cuda._sleep(1_000_000)  # ~0.5 ms of a spinning kernel on the current stream, which the read waits for
        read = transport.read_blocks("prefill", local_ids, remote_ids)
        read.wait()
        host.append(read.launched_s)
        gpu.append(read.gpu_s)
    return {
        f"{way} host us": round(statistics.median(host) * 1e6, 1),
        f"{way} gpu us": round(statistics.median(gpu) * 1e6, 1),
    }


def host_profile(transport: CudaIpcTransport, local_ids: list[int], remote_ids: list[int], reads: int = 400) -> str:
    """cProfile of ``reads`` reads' host work (each waited for): where the launch's microseconds go."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    for _ in range(reads):
        profile.enable()
        read = transport.read_blocks("prefill", local_ids, remote_ids)
        profile.disable()
        read.wait()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(18)
    return out.getvalue()


def same_process_gather(
    local: dict[str, torch.Tensor], geometry: Geometry, local_ids: list[int], remote_ids: list[int], iters: int
) -> float:
    """Median GPU seconds of the same Triton gather between two caches of this process (no IPC mapping):
    what the scatter costs apart from the mapping."""
    from connectors.block_ranges import whole_plane_ranges
    from connectors.transport.base import cache_regions
    from connectors.transport.gather import OffsetRing, TritonGather, run_table

    src = caches(geometry, SOURCE_SEED)
    src_regions = cache_regions(src, geometry.plane_bytes, 1, "bench")
    dst_regions = cache_regions(local, geometry.plane_bytes, 1, "bench")
    table = run_table(
        whole_plane_ranges(1, geometry.plane_bytes),
        dst_regions,
        src_regions,
        np.asarray(dst_regions.region_addrs, dtype=np.int64),
        np.asarray(src_regions.region_addrs, dtype=np.int64),
    )
    gather, ring = TritonGather(), OffsetRing(1)
    device = torch.device("cuda", 0)
    stream = torch.cuda.current_stream(device)
    peer = gather.upload(table, device)
    count = len(remote_ids)
    slot = ring.take(2 * count, device)
    slot.write(peer, np.asarray(remote_ids, dtype=np.int64), np.asarray(local_ids, dtype=np.int64))
    slot.on_device.copy_(slot.offsets)
    times = []
    for _ in range(iters + 1):
        started, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # the GPU busy while the host launches: the events time the gather alone
        started.record()
        gather(peer, slot.on_device.data_ptr(), count, stream)
        done.record()
        done.synchronize()
        times.append(started.elapsed_time(done) / 1e3)
    del src
    return statistics.median(times[1:])


def sweep(source: Source, local: dict[str, torch.Tensor], geometry: Geometry, sizes_mib: list[int], iters: int):
    """GPU time of the Triton gather per (words per program, warps)."""
    payload, regions = source.offers[CUDA_IPC]
    results = []
    for chunk, warps, hints, direct, offsets_on in SWEEP:
        transport = CudaIpcTransport(
            "decode-sweep", copy="triton", triton_chunk=chunk, triton_warps=warps, offsets_on=offsets_on
        )
        transport.register_kv_caches(local, geometry.plane_bytes, planes_per_layer=1)
        transport.add_peer("prefill", payload, regions)
        transport.read_blocks("prefill", [0], [0]).wait()
        transport._gather.hints &= hints  # noqa: SLF001 - a benchmark's choice of the kernel's variant
        transport._gather.fast_launch &= direct  # noqa: SLF001
        for size_mib in sizes_mib:
            local_ids, remote_ids = pick_blocks(geometry, size_mib, seed=size_mib)
            timed = phases(transport, "x", local_ids, remote_ids, iters)
            results.append(
                {
                    "chunk": chunk,
                    "warps": warps,
                    "16-byte hints": transport._gather.hints,  # noqa: SLF001
                    "direct launch": transport._gather.fast_launch,  # noqa: SLF001
                    "offsets on": offsets_on,
                    "size_mib": size_mib,
                    "host us": timed["x host us"],
                    "gpu us": timed["x gpu us"],
                    "GB/s": round(len(local_ids) * geometry.block_bytes / timed["x gpu us"] / 1e3, 1),
                }
            )
            post = read_post(transport, "prefill", local_ids, remote_ids)
            for mode, seconds in zip(MODES, timings(post, iters), strict=True):
                results[-1][f"GB/s {mode}"] = round(len(local_ids) * geometry.block_bytes / seconds / GB, 1)
            print(json.dumps(results[-1]), flush=True)
        transport.close()
    return results


def timings(post: Callable[[], Callable[[], None]], iters: int) -> tuple[float, float]:
    """``(one at a time, pipelined)`` seconds per step, after ``iters`` steps of warm-up (a CUDA IPC transport's
    ring of slots made, Triton's kernel compiled)."""
    for _ in range(iters):
        post()()
    return one_at_a_time(lambda: post()(), iters), pipelined(post, iters)


def measure(
    geometry: Geometry, sizes_mib: list[int], iters: int, nixl_iters: int, do_sweep: bool = False, profile: bool = False
) -> dict[str, object]:
    with_nixl = importlib.util.find_spec("nixl") is not None
    names = (CUDA_IPC, NIXL) if with_nixl else (CUDA_IPC,)
    source = start_source(geometry, names)
    rows, failures = [], []
    try:
        local = caches(geometry, None)
        readers = {
            WAYS[0]: CudaIpcTransport("decode-triton", copy="triton"),
            WAYS[1]: CudaIpcTransport("decode-triton-torch", copy="triton", driver="torch"),
            WAYS[2]: CudaIpcTransport("decode-torch", copy="torch"),
        }
        if with_nixl:
            readers["nixl"] = make_transport(NIXL, "decode-nixl", 120.0)
        for way, transport in readers.items():
            transport.register_kv_caches(local, geometry.plane_bytes, planes_per_layer=1)
            payload, regions = source.offers[NIXL if way == "nixl" else CUDA_IPC]
            transport.add_peer("prefill", payload, regions)
        for size_mib in sizes_mib:
            local_ids, remote_ids = pick_blocks(geometry, size_mib, seed=size_mib)
            num_bytes = len(local_ids) * geometry.block_bytes
            reference = timings(copy_post(num_bytes), iters)
            row: dict[str, object] = {"size_mib": size_mib, "blocks": len(local_ids), "bytes": num_bytes}
            for mode, seconds in zip(MODES, reference, strict=True):
                row[f"device copy GB/s {mode}"] = round(num_bytes / seconds / GB, 1)
            for way, transport in readers.items():
                for cache in local.values():
                    cache.zero_()
                post = read_post(transport, "prefill", local_ids, remote_ids)
                post()()
                wrong = check_blocks(geometry, local, local_ids, remote_ids)
                if wrong:
                    failures.append(f"{way}, {size_mib} MiB: {len(wrong)} layers differ, first {wrong[0]}")
                measured = timings(post, nixl_iters if way == "nixl" else iters)
                for cache in local.values():
                    cache.zero_()
                post()()  # and once more after the timed reads (Triton: the compiled kernel, launched directly)
                if wrong := check_blocks(geometry, local, local_ids, remote_ids):
                    failures.append(f"{way}, {size_mib} MiB, after timing: {len(wrong)} layers differ")
                for mode, seconds, reference_s in zip(MODES, measured, reference, strict=True):
                    row[f"{way} GB/s {mode}"] = round(num_bytes / seconds / GB, 2)
                    row[f"{way} / device copy {mode}"] = round(reference_s / seconds, 3)
                if isinstance(transport, CudaIpcTransport):
                    row.update(phases(transport, way, local_ids, remote_ids, iters))
                if way == WAYS[0] and profile:
                    row["host profile"] = host_profile(transport, local_ids, remote_ids)
            in_order = list(range(len(local_ids)))
            contiguous = phases(readers[WAYS[0]], "x", in_order, in_order, iters)["x gpu us"]
            row["cuda-ipc (triton), blocks in order GB/s gpu"] = round(num_bytes / contiguous / 1e3, 1)
            same_s = same_process_gather(local, geometry, local_ids, remote_ids, iters)
            row["same-process gather GB/s gpu"] = round(num_bytes / same_s / GB, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
        for transport in readers.values():
            transport.close()
        swept = sweep(source, local, geometry, sizes_mib, iters) if do_sweep else []
    finally:
        source.stop()
    properties = torch.cuda.get_device_properties(0)
    return {
        "device": properties.name,
        "torch": torch.__version__,
        "geometry": geometry.__dict__,
        "iters": iters,
        "rows": rows,
        "sweep": swept,
        "failures": failures,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--nixl-iters", type=int, default=3)
    parser.add_argument("--layers", type=int, default=Geometry.layers)
    parser.add_argument("--blocks", type=int, default=Geometry.blocks)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--sweep", action="store_true", help="also time the Triton gather's launch shapes")
    parser.add_argument("--profile", action="store_true", help="also profile the Triton reads' host work (cProfile)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    geometry = Geometry(layers=args.layers, blocks=args.blocks)
    result = measure(geometry, args.sizes_mib, args.iters, args.nixl_iters, args.sweep, args.profile)
    print(f"\n{result['device']} (torch {result['torch']}), {args.iters} reads per figure after a warm-up:")
    for row in result["rows"]:
        for mode in MODES:
            ways = ", ".join(
                f"{way} {row[f'{way} GB/s {mode}']} GB/s ({row[f'{way} / device copy {mode}']:.0%})"
                for way in WAYS
                if f"{way} GB/s {mode}" in row
            )
            print(
                f"  {row['size_mib']:>4} MiB in {row['blocks']} blocks, {mode}: "
                f"device copy {row[f'device copy GB/s {mode}']} GB/s; {ways}"
            )
    for row in result["rows"]:
        if "host profile" in row:
            print(f"\nhost work of a {row['size_mib']} MiB Triton read, cProfile:\n{row['host profile']}")
    for failure in result["failures"]:
        print(f"MISMATCH: {failure}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
