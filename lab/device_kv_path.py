"""On a GPU host, what the KV path runs on and how fast, in one run: ``pdserve doctor``'s report without a spec
(this host's probe, each path's transport, measured), then NIXL over VRAM under several ``UCX_TLS`` settings with
UCX's choice of protocols printed (``UCX_PROTO_INFO=y``), and CUDA IPC, each measured as the doctor measures
(64 MiB of scattered blocks of a 7-8B model's cache, two processes, against a device copy).

Run from the repository root: ``python lab/device_kv_path.py [--json FILE]`` (NIXL from pdserve's gpu extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.doctor import DEFAULT_GEOMETRY, examine, render  # noqa: E402
from orchestrator.doctor.measure import Geometry, Measurement, attempt  # noqa: E402

SETTINGS = ({}, {"UCX_TLS": "cuda_ipc,cuda_copy,tcp"}, {"UCX_TLS": "tcp,cuda_copy"})
"""UCX settings tried for NIXL over VRAM. (``UCX_PROTO_ENABLE=n``, UCX's protocols of before 1.13, was tried on the
H200 of 2026-12-04: NIXL could not post a READ under it, NIXL_ERR_BACKEND.)"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    examination = examine(None, measured=True)
    print("\n".join(render(examination, None)), flush=True)
    geometry = Geometry(block_size=16, **DEFAULT_GEOMETRY)
    rows = []
    for setting in SETTINGS:
        env = {"UCX_PROTO_INFO": "y", **setting}
        rows.append({"transport": "nixl", "env": setting, "result": attempt(geometry, env, "cuda", "nixl")})
    rows.append({"transport": "cuda-ipc", "env": {}, "result": attempt(geometry, {}, "cuda", "cuda-ipc")})
    print("\nVRAM -> VRAM, two processes on GPU 0, 64 MiB of scattered blocks:")
    for row in rows:
        result = row["result"]
        what = (
            f"{result.gbps:.2f} GB/s, {100 * result.share_of_copy:.1f} % of a device copy ({result.copy_gbps:.0f} "
            f"GB/s){'' if result.checked else ', BYTES DIFFER'}"
            if isinstance(result, Measurement)
            else f"failed: {result}"
        )
        env = " ".join(f"{name}={value}" for name, value in row["env"].items()) or "(UCX's defaults)"
        print(f"  {row['transport']:8} {env:55} {what}")
    if args.json:
        data = {"doctor": examination.to_json(), "vram": [
            {**row, "result": row["result"].to_json() if isinstance(row["result"], Measurement) else row["result"]}
            for row in rows
        ]}  # fmt: skip
        args.json.write_text(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
