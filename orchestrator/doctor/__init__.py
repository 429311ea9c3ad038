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
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from connectors.transport import CUDA_IPC, NIXL, Where
from orchestrator.doctor.diagnose import BROKEN, SLOW, Finding, PathReport, Pools, default_pools, diagnose, pools_of
from orchestrator.doctor.measure import Geometry, Measurement, attempt
from orchestrator.doctor.probes import HostProbe, probe_host

if TYPE_CHECKING:
    from orchestrator.spec import ClusterSpec

__all__ = ["Examination", "examine", "examine_cluster", "geometry_of", "render"]

DEFAULT_GEOMETRY = {"layers": 32, "heads": 8, "head_dim": 128}
"""A cache of a 7-8B model (one TP rank), where no model config says otherwise."""
NOT_FASTER_THAN_TCP = 1.5
"""A same-node path measured at less than this many times TCP's speed is taken to run over TCP."""


@dataclass
class Examination:
    probes: dict[str, HostProbe]
    """Each host probed, by name (``this host``, or a node's address beside a running cluster)."""
    reports: list[PathReport]
    geometry: Geometry
    geometry_from: str

    def to_json(self) -> dict:
        geometry = {**self.geometry.__dict__, "block_bytes": self.geometry.block_bytes, "from": self.geometry_from}
        return {
            "hosts": {name: probe.to_json() for name, probe in self.probes.items()},
            "geometry": geometry,
            "paths": [report.to_json() for report in self.reports],
        }


Runner = Callable[[PathReport, Geometry, dict[str, str], str, str], "Measurement | str"]
"""Runs a measurement for a report where its host is (``attempt`` here; a Ray task on a cluster's node), with the
environment, memory and transport given."""
THIS_HOST = "this host"


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
    for report in reports:
        report.host = THIS_HOST
    geometry, whence = geometry_of(spec, pools[0].memory)
    if measured:
        _measure(reports, geometry, {p.model: p.tls for p in pools}, lambda _, *how: attempt(*how))
    return Examination({THIS_HOST: probe}, reports, geometry, whence)


def examine_cluster(measured: bool = True) -> Examination:
    """Beside the running cluster: its spec, every node of its Ray cluster probed there (Ray tasks), and each
    model's paths in the places its engines are in, with the probe of the node its decode engines run on;
    measurements run on that node."""
    from orchestrator import cluster as clusters
    from orchestrator.doctor.remote import engine_places, on_nodes
    from orchestrator.ray_head import ray_connection
    from orchestrator.spec import ClusterSpec
    from orchestrator.state import ClusterState

    state = ClusterState.load()
    engines = clusters.status()["engines"]
    spec = ClusterSpec.from_file(state.config)
    with ray_connection(state) as ray:
        nodes = {node.node_id: node for node in on_nodes(ray)}
        reports, tls = [], {}
        for node in nodes.values():
            for pools in pools_of(spec, node.probe):
                wheres = engine_places(engines, list(nodes.values()), pools.model).get(node.node_id)
                if not wheres:
                    continue
                placed = tuple((w, f"engines of {state.name} on {node.address}") for w in sorted(wheres))
                for report in diagnose([replace(pools, places=placed)], node.probe):
                    report.host = node.address
                    reports.append(report)
                tls[pools.model] = pools.tls
        geometry, whence = geometry_of(spec, "cuda" if spec.device == "cuda" else "cpu")
        if measured:
            by_address = {node.address: node for node in nodes.values()}
            _measure(reports, geometry, tls, lambda report, *how: by_address[report.host].measure(*how))
    return Examination({node.address: node.probe for node in nodes.values()}, reports, geometry, whence)


def _measure(reports: list[PathReport], geometry: Geometry, tls: dict[str, str | None], run_on: Runner) -> None:
    """Measure each path its host can run (each setting once per host); TCP too, to tell a same-node path
    from it."""
    done: dict[tuple[str, str | None, str, str], Measurement | str] = {}

    def run(report: PathReport, env_tls: str | None, transport: str = NIXL) -> Measurement | str:
        key = (report.host, env_tls, report.memory, transport)
        if key not in done:
            env = {"UCX_TLS": env_tls} if env_tls else {}
            done[key] = run_on(report, geometry, env, report.memory, transport)
        return done[key]

    def attach(report: PathReport, env_tls: str | None, transport: str = NIXL) -> Measurement | None:
        result = run(report, env_tls, transport)
        if isinstance(result, str):
            report.findings.append(Finding(BROKEN, f"a {transport} READ failed here: {result}"))
            return None
        report.measurement = result
        return result

    for report in reports:
        # UCX moves VRAM over TCP only with cuda_copy beside it, staging through host memory
        tcp = "tcp,cuda_copy" if report.memory == "cuda" else "tcp"
        if report.transport == CUDA_IPC:
            attach(report, None, CUDA_IPC)
        elif report.transport != NIXL:
            report.not_measured = f"{report.transport}: not measured by doctor"
        elif report.place is Where.OTHER_NODE:
            report.not_measured = "another node: measured over TCP on this host's loopback, the ceiling of TCP"
            attach(report, tcp)
        elif (own := attach(report, tls[report.model])) is not None and any(t != "tcp" for t in report.ucx):
            over_tcp = run(report, tcp)
            if isinstance(over_tcp, Measurement) and own.gbps < NOT_FASTER_THAN_TCP * over_tcp.gbps:
                report.findings.append(_no_faster_than_tcp(report, own, over_tcp))


def _no_faster_than_tcp(report: PathReport, own: Measurement, tcp: Measurement) -> Finding:
    faster = ", ".join(t for t in report.ucx if t != "tcp")
    what = f"measured {own.gbps:.2f} GB/s, no faster than TCP ({tcp.gbps:.2f} GB/s): UCX did not take {faster}"
    fix = "UCX_PROTO_INFO=y in engine.env makes UCX print the protocols it picks"
    if report.memory == "cuda":
        # With nixl-cu13 1.5.1 on an H200, UCX names the peer's GPU an unknown device (cuda/dev[1]) and reads
        # it over TCP whatever UCX_TLS allows; with UCX_PROTO_ENABLE=n no READ can be posted.
        what += " (UCX's protocol table, UCX_PROTO_INFO=y, shows 'tcp' for reads from the peer's GPU)"
        fix = (
            "keep cuda-ipc first in connector_options.transports: between engines of one node whose GPU the "
            "reader sees it moves KV device to device without UCX; " + fix
        )
    return Finding(SLOW, what, fix)


def render(examination: Examination, config: str | None) -> list[str]:
    """``pdserve doctor``'s report as text."""
    g = examination.geometry
    lines = [f"pdserve doctor: {config or 'no spec (pdserve defaults)'}"]
    for name, probe in examination.probes.items():
        lines += _host_lines(name, probe)
    lines.append(
        f"cache: {g.layers} layers x {g.heads} heads x {g.block_size} tokens x {g.head_dim} head dim, {g.dtype} "
        f"({g.block_bytes / 2**20:.2f} MiB a block), from {examination.geometry_from}"
    )
    for report in examination.reports:
        where = "" if report.host == THIS_HOST else f" (decode on {report.host})"
        lines.append(
            f"{report.model}: prefill -> decode, {report.place}{where}, {report.memory} memory: {report.verdict}"
        )
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


def _host_lines(name: str, probe: HostProbe) -> list[str]:
    nixl = (
        f"NIXL {probe.nixl_version} ({probe.nixl_build}; backends {', '.join(probe.nixl_plugins) or 'unknown'})"
        if probe.nixl_build
        else "NIXL: not importable"
    )
    gpus = ", ".join(f"{gpu.index}: {gpu.name} {gpu.uuid}" for gpu in probe.gpus) or "none"
    lines = [
        f"{name} ({probe.node or 'node unknown'})",
        f"  {nixl}",
        f"  UCX modules: {', '.join(probe.ucx_modules) or 'none found'} (and tcp, posix, sysv); "
        f"UCX_TLS {probe.ucx_tls or 'unset'}",
        f"  RDMA devices: {', '.join(probe.rdma_devices) or 'none'}; GPUs: {gpus}",
    ]
    if len(probe.gpus) > 1:
        lines.append("  peer access: " + "; ".join(
            f"{i}->{j} {'yes' if ok else 'no'}" for i, row in enumerate(probe.peer_access)
            for j, ok in enumerate(row) if i != j))  # fmt: skip
    lines += [f"  UCX module {name} does not load: {error}" for name, error in sorted(probe.ucx_module_errors.items())]
    return lines + [f"  could not probe: {problem}" for problem in probe.problems]
