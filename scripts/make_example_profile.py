"""Write configs/profiles/example-gpu.yaml: an ILLUSTRATIVE GPU profile for the autoscaling simulator.

Nothing here was measured. The numbers come from a roofline estimate of a
70B-class dense model (80 layers, hidden size 8192, GQA with 8 KV heads of 128,
bf16) served by one engine on 4 A100-80GB-class GPUs (tensor parallel 4), so that the
simulator can be run at 64-engine scale before a real ``pdserve profile`` exists:

- prefill pass: 10 ms fixed + 140 GFLOP per token and 2*80*8192*L^2 FLOP of
  attention per sequence of L tokens, at 50 % of 4 x 312 TFLOP/s;
- decode step: 4 ms fixed + reading 140 GB of weights and batch*context*320 KiB
  of KV at 80 % of 4 x 2.0 TB/s, + 140 GFLOP per sequence at 60 % of peak;
- KV transfer: 2 ms + bytes at 25 GB/s (RDMA);
- KV capacity: 400,000 tokens per decode engine (4 x 80 GB x 0.9, less weights);
- startup: 60 s (weights on local disk, graphs captured).

Replace it with a measured profile (``pdserve profile``) to judge a real deployment.

    python scripts/make_example_profile.py [--out configs/profiles/example-gpu.yaml]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from orchestrator.autoscale.profile import EngineLimits, Grid1D, Grid2D, PerformanceProfile

PARAMS = 70e9
LAYERS, HIDDEN = 80, 8192
KV_BYTES_PER_TOKEN = 2 * LAYERS * 8 * 128 * 2  # K and V, 8 KV heads of 128, bf16
GPUS = 4
PEAK_FLOPS, HBM_BYTES_S = 312e12, 2.0e12


def prefill_seconds(tokens: float, batch: float) -> float:
    per_seq = tokens / batch
    flops = 2 * PARAMS * tokens + batch * 2 * LAYERS * HIDDEN * per_seq**2
    return 0.010 + flops / (GPUS * PEAK_FLOPS * 0.50)


def decode_step_seconds(batch: float, context: float) -> float:
    memory = (2 * PARAMS + batch * context * KV_BYTES_PER_TOKEN) / (GPUS * HBM_BYTES_S * 0.80)
    return 0.004 + memory + batch * 2 * PARAMS / (GPUS * PEAK_FLOPS * 0.60)


def build() -> PerformanceProfile:
    tokens = [128, 512, 1024, 2048, 4096, 8192, 16384]
    prefill_batch = [1, 2, 4, 8, 16, 32]
    decode_batch = [1, 8, 16, 32, 64, 128, 192, 256]
    context = [512, 2048, 4096, 8192, 16384]
    nbytes = [1e6, 1e8, 1e9, 1e10]
    return PerformanceProfile(
        name="example-gpu",
        provenance="ILLUSTRATIVE, NOT MEASURED: roofline estimate of a 70B-class dense model on one "
        "4 x A100-80GB-class engine (TP 4); see scripts/make_example_profile.py for the formulas.",
        engine=EngineLimits(
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            kv_capacity_tokens=400_000,
            kv_bytes_per_token=KV_BYTES_PER_TOKEN,
            startup_s=60.0,
        ),
        prefill=Grid2D(
            [float(t) for t in tokens],
            [float(b) for b in prefill_batch],
            [[round(prefill_seconds(t, b), 5) for b in prefill_batch] for t in tokens],
        ),
        decode=Grid2D(
            [float(b) for b in decode_batch],
            [float(c) for c in context],
            [[round(decode_step_seconds(b, c), 5) for c in context] for b in decode_batch],
        ),
        transfer=Grid1D(nbytes, [round(0.002 + n / 25e9, 5) for n in nbytes]),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "configs/profiles/example-gpu.yaml"))
    args = parser.parse_args()
    profile = build()
    profile.save(args.out)
    header = "# " + "\n# ".join(__doc__.strip().splitlines()[:16]).replace("# \n", "#\n") + "\n"
    Path(args.out).write_text(header + Path(args.out).read_text())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
