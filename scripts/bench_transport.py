"""Throughput of NixlKVTransport.read_blocks against raw NIXL and a one-process torch copy.

A spawned *source* process registers a KV cache (``--layers`` x [2, blocks,
block_size, heads, head_dim]) with a NixlKVTransport. For each size in
``--sizes-mib`` this process then reads that many bytes of randomly chosen
blocks into other random local blocks, three ways:

* ``ours``: ``read_blocks`` + ``wait`` (one batched READ, xfer creation included);
* ``raw``: a second, bare nixl agent (same progress mode) reading the same
  descriptors with a pre-built handle (``initialize_xfer`` outside the
  timer): the NIXL ceiling;
* ``torch_copy``: ``Tensor.copy_`` of a contiguous buffer of the same bytes.

``--device cuda`` puts both caches (and the copy) on GPU 0: VRAM to VRAM
between two processes (UCX's CUDA IPC on one host).

Each is warmed up once, then timed ``--iters`` times; the median is reported.
Run from the repository root: ``.venv/bin/python scripts/bench_transport.py [--json]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

# A script, not a package module: make ``connectors`` importable when run by path (here and in the spawned source).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connectors.transport.nixl import (  # noqa: E402
    DEFAULT_PROGRESS_WAKE_US,
    PROGRESS_MODES,
    KVRegions,
    NixlKVTransport,
    TransferState,
    make_agent,
)

GIB = 1e9
POLL_INTERVAL_S = 0.0002


def kv_shape(args: argparse.Namespace, num_blocks: int) -> tuple[int, ...]:
    return (2, num_blocks, args.block_size, args.heads, args.head_dim)


def plane_bytes(args: argparse.Namespace) -> int:
    return args.block_size * args.heads * args.head_dim * torch.finfo(getattr(torch, args.dtype)).bits // 8


def run_source(conn, args: argparse.Namespace, num_blocks: int) -> None:
    dtype = getattr(torch, args.dtype)
    caches = {
        f"layer.{i}": torch.randn(kv_shape(args, num_blocks)).to(device=args.device, dtype=dtype)
        for i in range(args.layers)
    }
    with NixlKVTransport("bench-source", num_threads=args.threads, progress=args.progress) as transport:
        regions = transport.register_kv_caches(caches, plane_bytes(args))  # before the metadata, which lists it
        conn.send((transport.handshake_payload(), regions))
        if args.progress != "caller":
            conn.recv()  # "stop": NIXL's thread progresses the source
            return
        while not conn.poll(POLL_INTERVAL_S):  # "caller": poll as a prefill engine's steps do
            transport.poll_notifications()


def plane_descriptors(regions: KVRegions, block_ids: np.ndarray) -> np.ndarray:
    """Nx3 descriptors of every region's plane of ``block_ids``: the bytes ``read_blocks`` moves."""
    rows = regions.descriptors().reshape(len(regions.region_addrs), regions.num_blocks, 3)
    return np.ascontiguousarray(rows[:, block_ids].reshape(-1, 3))


def timed(fn, iters: int) -> float:
    fn()  # warm-up: connection setup, page faults
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench(args: argparse.Namespace) -> dict:
    block_bytes = args.layers * 2 * plane_bytes(args)
    counts = [max(1, int(mib * 2**20) // block_bytes) for mib in args.sizes_mib]
    num_blocks = max(counts)
    dtype = getattr(torch, args.dtype)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    source = ctx.Process(target=run_source, args=(child_conn, args, num_blocks), daemon=True)
    source.start()
    ours = raw_agent = None
    try:
        if not conn.poll(120):
            raise TimeoutError("source process did not start")
        metadata, remote_regions = conn.recv()
        caches = {
            f"layer.{i}": torch.zeros(kv_shape(args, num_blocks), dtype=dtype, device=args.device)
            for i in range(args.layers)
        }
        ours = NixlKVTransport("bench-reader", transfer_timeout_s=60, num_threads=args.threads, progress=args.progress)
        local_regions = ours.register_kv_caches(caches, plane_bytes(args))
        ours.add_peer("bench-source", metadata, remote_regions)

        raw_agent, _ = make_agent("bench-raw-reader", ["UCX"], args.threads, args.progress, DEFAULT_PROGRESS_WAKE_US)
        raw_agent.register_memory(list(caches.values()))
        raw_peer = raw_agent.add_remote_agent(metadata)

        rng = np.random.default_rng(0)
        results = []
        for count in counts:
            remote_ids = rng.permutation(num_blocks)[:count]
            local_ids = rng.permutation(num_blocks)[:count]
            nbytes = count * block_bytes

            def read_ours(local_ids=local_ids, remote_ids=remote_ids) -> None:
                read = ours.read_blocks("bench-source", local_ids, remote_ids, notify=b"bench")
                if read.wait(POLL_INTERVAL_S) is not TransferState.DONE:
                    raise read.failure_exception()

            mem = local_regions.mem_type
            local_descs = raw_agent.get_xfer_descs(plane_descriptors(local_regions, local_ids), mem)
            remote_descs = raw_agent.get_xfer_descs(plane_descriptors(remote_regions, remote_ids), mem)
            raw_xfer = raw_agent.initialize_xfer("READ", local_descs, remote_descs, raw_peer)

            def read_raw(raw_xfer=raw_xfer) -> None:
                state = raw_agent.transfer(raw_xfer)
                while state == "PROC":
                    time.sleep(POLL_INTERVAL_S)
                    state = raw_agent.check_xfer_state(raw_xfer)
                if state != "DONE":
                    raise RuntimeError(f"raw NIXL READ ended {state}")

            src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=args.device)
            dst = torch.empty_like(src)

            def copy(dst=dst, src=src) -> None:
                dst.copy_(src)
                if dst.is_cuda:
                    torch.cuda.synchronize()

            t_ours = timed(read_ours, args.iters)
            t_raw = timed(read_raw, args.iters)
            t_copy = timed(copy, args.iters)
            raw_agent.release_xfer_handle(raw_xfer)
            results.append(
                {
                    "blocks": count,
                    "descriptors": count * len(local_regions.region_addrs),
                    "descriptor_bytes": local_regions.block_len_bytes,
                    "mib": nbytes / 2**20,
                    "ours_gbps": nbytes / t_ours / GIB,
                    "raw_nixl_gbps": nbytes / t_raw / GIB,
                    "torch_copy_gbps": nbytes / t_copy / GIB,
                    "ours_over_raw": t_raw / t_ours,
                    "ours_over_torch_copy": t_copy / t_ours,
                }
            )
        return {
            "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(0),
            "layers": args.layers,
            "block_shape": [args.block_size, args.heads, args.head_dim],
            "dtype": args.dtype,
            "iters": args.iters,
            "nixl_threads": args.threads,
            "progress": args.progress,
            "torch_threads": torch.get_num_threads(),
            "results": results,
        }
    finally:
        if ours is not None:
            ours.close()
        conn.send("stop")
        source.join(10)
        if source.is_alive():
            source.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[64, 256])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="NIXL/UCX progress threads of every agent")
    parser.add_argument(
        "--progress",
        default="thread",
        choices=PROGRESS_MODES,
        help="every agent's progress mode; 'nixl': NIXL's default thread, which spins (default: %(default)s)",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both KV caches live")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()
    # nixl logs INFO to stdout when first imported; keep stdout to the report (the spawned source inherits this).
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    report = bench(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"{args.layers} layers x [2, blocks, {args.block_size}, {args.heads}, {args.head_dim}] {args.dtype} "
        f"on {report['device']}, median of {args.iters}, progress {args.progress}"
    )
    print(f"{'MiB':>6} {'blocks':>6} {'descs':>6} {'ours':>7} {'raw':>7} {'copy':>7} {'ours/raw':>9} {'ours/copy':>9}")
    for r in report["results"]:
        print(
            f"{r['mib']:>6.0f} {r['blocks']:>6} {r['descriptors']:>6} {r['ours_gbps']:>7.2f} "
            f"{r['raw_nixl_gbps']:>7.2f} {r['torch_copy_gbps']:>7.2f} "
            f"{r['ours_over_raw']:>9.2f} {r['ours_over_torch_copy']:>9.2f}"
        )
    print("GB/s = 1e9 bytes/s")


if __name__ == "__main__":
    main()
