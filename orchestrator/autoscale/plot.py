"""Draw a simulation: load, replicas and latencies over time (matplotlib, imported only here)."""

from __future__ import annotations

import os

from orchestrator.autoscale.sim_model import SimulationResult
from orchestrator.errors import PdserveError

__all__ = ["PlotUnavailable", "plot_result", "require_matplotlib"]


class PlotUnavailable(PdserveError):
    """matplotlib is not installed."""


def require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailable(
            "--plot needs matplotlib, which is not installed: pip install 'pdserve[dev]' (or matplotlib)"
        ) from e
    return plt


def plot_result(result: SimulationResult, path: str | os.PathLike[str], title: str = "") -> None:
    plt = require_matplotlib()
    timeline = result.timeline
    minutes = [row["t"] / 60 for row in timeline]
    fig, (load, replicas, latency) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    load.plot(minutes, [row["arrival_rps"] for row in timeline], color="black")
    load.set_ylabel("arrivals (req/s)")
    replicas.step(minutes, [row["prefill"] for row in timeline], where="post", label="prefill (target)")
    replicas.step(minutes, [row["decode"] for row in timeline], where="post", label="decode (target)")
    replicas.step(minutes, [row["engines"] for row in timeline], where="post", label="engines running", ls=":")
    replicas.set_ylabel("engines")
    replicas.legend(loc="upper left")
    targets = result.targets
    ttft = [row["ttft_p90_s"] if row["ttft_p90_s"] is not None else float("nan") for row in timeline]
    itl = [row["itl_p90_s"] * 1000 if row["itl_p90_s"] is not None else float("nan") for row in timeline]
    latency.plot(minutes, ttft, label="p90 TTFT (s)", color="tab:red")
    latency.axhline(targets.ttft_s, color="tab:red", ls="--", lw=0.8)
    latency.set_ylabel("p90 TTFT (s)")
    latency.set_yscale("log")
    itl_axis = latency.twinx()
    itl_axis.plot(minutes, itl, label="p90 ITL (ms)", color="tab:blue")
    itl_axis.axhline(targets.itl_s * 1000, color="tab:blue", ls="--", lw=0.8)
    itl_axis.set_ylabel("p90 ITL (ms)")
    latency.set_xlabel("minutes")
    summary = result.summary()
    fig.suptitle(
        f"{title}  SLO {summary['slo_attainment']:.1%}, {summary['engine_hours']:.1f} engine-h, "
        f"{summary['goodput_per_engine_hour']:.0f} good req/engine-h".strip()
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
