"""``pdserve doctor``: the KV path a spec implies on this host, what it runs on, how fast it is, and what to fix.

``probes.probe_host`` looks at the host (NIXL's build and backends, UCX's modules, RDMA devices, GPUs and their
peer access); ``diagnose.diagnose`` decides, for each model's prefill -> decode pair in each place the spec lets
them be, the transport pdserve picks and what UCX can use underneath, with a finding and its fix for each
misconfiguration it knows; ``examine`` adds a measurement of each path this host can run
(``measure.measure``: 64 MiB of scattered blocks in the model's cache layout, two processes, the connector's
own NIXL transport, as GB/s and as a share of a same-process copy). On a CPU host that is UCX's shared memory
between two processes, and TCP (loopback: the ceiling of TCP between nodes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from connectors.transport import NIXL, Where
from orchestrator.doctor.diagnose import BROKEN, SLOW, Finding, PathReport, Pools, default_pools, diagnose, pools_of
from orchestrator.doctor.measure import Geometry, Measurement, measure
from orchestrator.doctor.probes import HostProbe, probe_host

if TYPE_CHECKING:
    from orchestrator.spec import ClusterSpec

__all__ = ["Examination", "examine", "geometry_of"]

DEFAULT_GEOMETRY = {"layers": 32, "heads": 8, "head_dim": 128}
"""A cache of a 7-8B model (one TP rank), where no model config says otherwise."""
NOT_FASTER_THAN_TCP = 1.5
"""A same-node path measured at less than this many times TCP's speed is taken to run over TCP."""


@dataclass
class Examination:
    probe: HostProbe
    reports: list[PathReport]
    geometry: Geometry
    geometry_from: str

    def to_json(self) -> dict:
        geometry = {**self.geometry.__dict__, "block_bytes": self.geometry.block_bytes, "from": self.geometry_from}
        return {
            "host": self.probe.to_json(),
            "geometry": geometry,
            "paths": [report.to_json() for report in self.reports],
        }


def geometry_of(spec: ClusterSpec | None, memory: str) -> tuple[Geometry, str]:
    """One decode rank's cache geometry: from the model's config.json, else ``DEFAULT_GEOMETRY``; and whence."""
    block_size = 16 if memory == "cuda" else 128  # vLLM 0.32's defaults (its CPU backend: 128)
    if spec is not None:
        from orchestrator.models import resolve_dtype, resolve_model

        config = Path(resolve_model(spec.model)) / "config.json"
        try:
            model = json.loads(config.read_text())
        except (OSError, ValueError):
            pass
        else:
            heads = model.get("num_key_value_heads") or model["num_attention_heads"]
            head_dim = model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]
            tp = spec.pool("decode").tensor_parallel_size
            dtype = resolve_dtype(spec.model, spec.engine.dtype)
            dtype = model.get("torch_dtype", "bfloat16") if dtype == "auto" else dtype
            if dtype not in ("float32", "float16", "bfloat16"):
                dtype = "bfloat16"
            geometry = Geometry(model["num_hidden_layers"], max(1, heads // tp), head_dim, block_size, dtype)
            return geometry, f"{config} (TP {tp})"
    return Geometry(block_size=block_size, **DEFAULT_GEOMETRY), "a 7-8B model's (no model config)"


def examine(spec: ClusterSpec | None, measured: bool = True, probe: HostProbe | None = None) -> Examination:
    """Probe, diagnose and (``measured``) measure every path of ``spec`` (None: pdserve's defaults) here."""
    probe = probe or probe_host()
    pools: list[Pools] = pools_of(spec, probe) if spec is not None else default_pools(probe)
    reports = diagnose(pools, probe)
    geometry, whence = geometry_of(spec, pools[0].memory)
    if measured:
        _measure(reports, geometry, {p.model: p.tls for p in pools})
    return Examination(probe, reports, geometry, whence)


def _measure(reports: list[PathReport], geometry: Geometry, tls: dict[str, str | None]) -> None:
    """Measure each path this host can run (each ``UCX_TLS`` once); TCP too, to tell a same-node path from it."""
    done: dict[str | None, Measurement | str] = {}

    def run(env_tls: str | None) -> Measurement | str:
        if env_tls not in done:
            try:
                done[env_tls] = measure(geometry, {"UCX_TLS": env_tls} if env_tls else {})
            except (RuntimeError, TimeoutError, OSError) as e:
                done[env_tls] = f"{type(e).__name__}: {e}"
        return done[env_tls]

    def attach(report: PathReport, env_tls: str | None) -> Measurement | None:
        result = run(env_tls)
        if isinstance(result, str):
            report.findings.append(Finding(BROKEN, f"a NIXL READ failed here: {result}"))
            return None
        report.measurement = result
        return result

    for report in reports:
        if report.transport != NIXL:
            report.not_measured = f"{report.transport}: measured by scripts/bench_cuda_ipc.py on a GPU host"
        elif report.memory == "cuda":
            report.not_measured = "VRAM: measured by scripts/bench_cuda_ipc.py on a GPU host"
        elif report.place is Where.OTHER_NODE:
            report.not_measured = "another node: measured over TCP on this host's loopback, the ceiling of TCP"
            attach(report, "tcp")
        elif (own := attach(report, tls[report.model])) is not None and any(t != "tcp" for t in report.ucx):
            tcp = run("tcp")
            if isinstance(tcp, Measurement) and own.gbps < NOT_FASTER_THAN_TCP * tcp.gbps:
                faster = ", ".join(t for t in report.ucx if t != "tcp")
                report.findings.append(
                    Finding(
                        SLOW,
                        f"measured {own.gbps:.2f} GB/s, no faster than TCP ({tcp.gbps:.2f} GB/s): UCX did not take "
                        f"{faster}",
                        "UCX_PROTO_INFO=y in engine.env makes UCX print the protocols it picks",
                    )
                )


def render(examination: Examination, config: str | None) -> list[str]:
    """``pdserve doctor``'s report as text."""
    probe, g = examination.probe, examination.geometry
    nixl = (
        f"NIXL {probe.nixl_version} ({probe.nixl_build}; backends {', '.join(probe.nixl_plugins) or 'unknown'})"
        if probe.nixl_build
        else "NIXL: not importable"
    )
    gpus = ", ".join(f"{gpu.index}: {gpu.name} {gpu.uuid}" for gpu in probe.gpus) or "none"
    lines = [
        f"pdserve doctor: {config or 'no spec (pdserve defaults)'}",
        f"host {probe.node or '?'}",
        f"  {nixl}",
        f"  UCX modules: {', '.join(probe.ucx_modules) or 'none found'} (and tcp, posix, sysv); "
        f"UCX_TLS {probe.ucx_tls or 'unset'}",
        f"  RDMA devices: {', '.join(probe.rdma_devices) or 'none'}; GPUs: {gpus}",
    ]
    if len(probe.gpus) > 1:
        lines.append("  peer access: " + "; ".join(
            f"{i}->{j} {'yes' if ok else 'no'}" for i, row in enumerate(probe.peer_access)
            for j, ok in enumerate(row) if i != j))  # fmt: skip
    lines += [f"  could not probe: {problem}" for problem in probe.problems]
    lines.append(
        f"cache: {g.layers} layers x {g.heads} heads x {g.block_size} tokens x {g.head_dim} head dim, {g.dtype} "
        f"({g.block_bytes / 2**20:.2f} MiB a block), from {examination.geometry_from}"
    )
    for report in examination.reports:
        lines.append(f"{report.model}: prefill -> decode, {report.place}, {report.memory} memory: {report.verdict}")
        lines.append(f"  transport {report.transport} ({report.why})")
        if report.ucx:
            lines.append(f"  UCX underneath: {', '.join(report.ucx)}")
        if (m := report.measurement) is not None:
            lines.append(
                f"  measured: {m.mib:.1f} MiB in {m.blocks} blocks ({m.descriptors} descriptors): {m.gbps:.2f} GB/s, "
                f"{100 * m.share_of_copy:.0f} % of a same-process copy ({m.copy_gbps:.2f} GB/s)"
                f"{'' if m.checked else '; THE BYTES READ DIFFER FROM THE SOURCE'}"
            )
        if report.not_measured:
            lines.append(f"  ({report.not_measured})")
        for finding in report.findings:
            lines.append(f"  {finding.level}: {finding.what}")
            if finding.fix:
                lines.append(f"    fix: {finding.fix}")
    return lines
