"""The KV paths a spec implies, and what each will run on: ``diagnose(spec, probe)``.

For each model and each place its two pools can be in (one node, or two: ``places``), a ``PathReport`` says the
transport pdserve picks (``connectors.transport.common_transports``, the choice the connector makes at its
handshake) and why the others stand aside; what NIXL's UCX will use underneath, from the host's probe
(``probes.HostProbe``) and the engines' ``UCX_TLS``; and ``Finding``s, each with the fix for a misconfiguration
it knows: a fallback to TCP where a faster transport exists, a missing backend, a NIXL wheel of another CUDA,
a UCX module that does not load, CUDA IPC impossible between GPUs without peer access.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from connectors.transport import CUDA_IPC, NIXL, Where, common_transports
from orchestrator.doctor.probes import HostProbe

if TYPE_CHECKING:
    from orchestrator.doctor.measure import Measurement
    from orchestrator.spec import ClusterSpec

__all__ = [
    "BROKEN", "INFO", "OK", "SLOW", "Finding", "PathReport", "Pools", "default_pools", "diagnose", "places",
    "pools_of", "ucx_allows", "ucx_path",
]  # fmt: skip

OK, INFO, SLOW, BROKEN = "ok", "info", "slow", "broken"
LEVELS = (OK, INFO, SLOW, BROKEN)

UCX_ALIASES = {
    "sm": ("posix", "sysv", "cma", "knem", "xpmem"),
    "shm": ("posix", "sysv", "cma", "knem", "xpmem"),
    "cuda": ("cuda_copy", "cuda_ipc", "gdr_copy"),
    "ib": ("rc", "rc_v", "rc_x", "ud", "ud_v", "ud_x", "dc", "dc_x"),
    "rc": ("rc", "rc_v", "rc_x"),
    "ud": ("ud", "ud_v", "ud_x"),
    "dc": ("dc", "dc_x"),
}
"""UCX_TLS's names of transport groups, as UCX expands them."""


@dataclass(frozen=True)
class Finding:
    level: str
    what: str
    fix: str | None = None


@dataclass
class PathReport:
    """One pool pair in one place: the transport, what runs underneath, and the findings."""

    model: str
    place: Where
    memory: str
    """Where the caches are: ``cpu`` or ``cuda``."""
    transports: tuple[str, ...]
    """Those both sides offer here, best first; the first is the one used."""
    why: str
    ucx: tuple[str, ...] = ()
    """The UCX transports NIXL can use here, best first (empty: NIXL is not on this path)."""
    findings: list[Finding] = field(default_factory=list)
    measurement: Measurement | None = None
    not_measured: str | None = None
    host: str = ""
    """The host whose probe decided it (its decode engines'), and where it was measured."""

    @property
    def transport(self) -> str:
        return self.transports[0] if self.transports else "none"

    @property
    def verdict(self) -> str:
        """``ok``, ``slow`` or ``broken``: the worst finding's (one for information only leaves it ``ok``)."""
        return max((f.level for f in self.findings if f.level != INFO), key=LEVELS.index, default=OK)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model, "host": self.host, "place": str(self.place), "memory": self.memory,
            "transport": self.transport,
            "transports": list(self.transports), "why": self.why, "ucx": list(self.ucx), "verdict": self.verdict,
            "findings": [f.__dict__ for f in self.findings],
            "measurement": self.measurement.to_json() if self.measurement else None, "not_measured": self.not_measured,
        }  # fmt: skip


def ucx_allows(tls: str | None, transport: str) -> bool:
    """Whether ``UCX_TLS=tls`` leaves UCX ``transport`` (a UCT name: posix, cuda_ipc, rc, tcp, ...)."""
    if not tls or tls.strip() in ("", "all"):
        return True
    items = [item.strip() for item in tls.split(",") if item.strip()]
    negated = bool(items) and items[0].startswith("^")
    if negated:
        items[0] = items[0][1:]
    named = any(transport == item or transport in UCX_ALIASES.get(item, ()) for item in items)
    return not named if negated else named


def ucx_path(probe: HostProbe, place: Where, memory: str, tls: str | None) -> tuple[str, ...]:
    """The UCX transports a NIXL READ can take here, best first (UCX picks among them when it posts the READ)."""
    modules = set(probe.ucx_modules)
    candidates: list[str] = []
    rdma = bool(probe.rdma_devices) and "ib" in modules
    if memory == "cuda":
        cuda = "cuda" in modules and "cuda" not in probe.ucx_module_errors and _build_matches(probe)
        if place is Where.SAME_NODE and cuda:
            candidates += ["cuda_ipc", "cuda_copy"]
        if place is Where.OTHER_NODE and rdma and cuda:
            candidates += ["rc", "dc"]  # GPUDirect RDMA
    else:
        if place is Where.SAME_NODE:
            candidates += ["posix", "sysv"] + (["cma"] if "cma" in modules else [])
        if place is Where.OTHER_NODE and rdma:
            candidates += ["rc", "dc", "ud"]
    candidates.append("tcp")
    return tuple(t for t in candidates if ucx_allows(tls, t))


def _build_matches(probe: HostProbe) -> bool:
    return probe.machine_cuda_major is None or probe.nixl_build == f"nixl_cu{probe.machine_cuda_major}"


def places(spec: ClusterSpec) -> tuple[tuple[Where, str], ...]:
    """Where a prefill and a decode engine of ``spec`` can be, each with the reason."""
    if spec.ray.address is None:
        return ((Where.SAME_NODE, "a local Ray head: every engine on this node"),)
    prefill, decode = spec.pool("prefill").placement.node_labels, spec.pool("decode").placement.node_labels
    if prefill != decode:
        return ((Where.OTHER_NODE, "the pools' node_labels differ"),)
    reason = "Ray may place the two pools on one node or on two"
    return ((Where.SAME_NODE, reason), (Where.OTHER_NODE, reason))


@dataclass(frozen=True)
class Pools:
    """What decides one model's KV path: its connector and transports, where its caches are, its UCX_TLS."""

    model: str
    connector: str
    transports: tuple[str, ...]
    memory: str
    tls: str | None
    places: tuple[tuple[Where, str], ...]


def pools_of(spec: ClusterSpec, probe: HostProbe) -> list[Pools]:
    """Each model's ``Pools`` (its engines get ``engine.env``'s UCX_TLS, else this environment's)."""
    return [
        Pools(
            view.model_name,
            view.connector,
            (NIXL,) if view.connector == "vllm-nixl" else tuple(view.pdserve_connector.transports),
            "cuda" if view.device == "cuda" else "cpu",
            view.engine.env.get("UCX_TLS", probe.ucx_tls),
            places(view),
        )
        for view in spec.views()
    ]


def default_pools(probe: HostProbe) -> list[Pools]:
    """Without a spec: pdserve's connector with its default transports, on this host's GPUs or CPU, both places."""
    from connectors.transport import DEFAULT_TRANSPORTS

    both = "no spec: both places"
    memory = "cuda" if probe.gpus else "cpu"
    return [Pools("(any)", "pdserve", DEFAULT_TRANSPORTS, memory, probe.ucx_tls,
                  ((Where.SAME_NODE, both), (Where.OTHER_NODE, both)))]  # fmt: skip


def diagnose(pools: list[Pools], probe: HostProbe) -> list[PathReport]:
    """Every model's prefill -> decode path in every place it can take (see the module's docstring)."""
    return [_path(model, probe, place, why) for model in pools for place, why in model.places]


def _path(pools: Pools, probe: HostProbe, place: Where, where_why: str) -> PathReport:
    findings: list[Finding] = []
    memory = pools.memory
    if pools.connector == "vllm-nixl":
        offered: tuple[str, ...] = (NIXL,)
        why = "connector vllm-nixl: vLLM's NixlConnector reads over NIXL only"
    else:
        offered = pools.transports
        why = f"connector pdserve, transports {', '.join(offered)}"
        if CUDA_IPC in offered and memory == "cpu":
            offered = tuple(t for t in offered if t != CUDA_IPC)
            findings.append(Finding(INFO, "cuda-ipc stands aside: the caches are in CPU memory"))
        elif CUDA_IPC in offered and place is Where.SAME_NODE and (cut := _without_peer_access(probe)):
            offered = tuple(t for t in offered if t != CUDA_IPC)
            findings.append(
                Finding(
                    SLOW,
                    f"cuda-ipc cannot read between GPUs without peer access ({cut}): engines placed on them "
                    "move KV over NIXL",
                    "GPUs with peer access (NVLink, or PCIe peer to peer enabled in the BIOS and driver) for the "
                    "engines of one node",
                )
            )
    transports = common_transports(offered, offered, place)
    if transports[:1] == (CUDA_IPC,) and not probe.gpus:
        findings.append(Finding(INFO, "no GPU on the host probed: the GPUs' peer access is not checked"))
    transports = common_transports(offered, offered, place)
    report = PathReport(pools.model, place, memory, transports, f"{where_why}; {why}", findings=findings)
    if not transports:
        findings.append(Finding(BROKEN, f"no transport of {', '.join(offered)} reaches a peer in this place"))
    elif transports[0] == NIXL:
        report.ucx = ucx_path(probe, place, memory, pools.tls)
        findings.extend(_nixl_findings(probe, place, memory, pools.tls, report.ucx))
    return report


def _without_peer_access(probe: HostProbe) -> str:
    """The pairs of the host's GPUs that cannot read each other, as text ('' when every pair can)."""
    return ", ".join(
        f"{i}->{j}" for i, row in enumerate(probe.peer_access) for j, ok in enumerate(row) if i != j and not ok
    )


def _nixl_findings(probe: HostProbe, place: Where, memory: str, tls: str | None, ucx: tuple[str, ...]) -> list[Finding]:
    findings = []
    if probe.nixl_build is None:
        reason = next((p for p in probe.problems if p.startswith("NIXL")), "NIXL is not importable")
        return [Finding(BROKEN, reason, "install pdserve's pinned dependencies (make setup, or pip install -e .)")]
    if probe.nixl_plugins and "UCX" not in probe.nixl_plugins:
        plugins = ", ".join(probe.nixl_plugins)
        fix = "reinstall the nixl wheel of this machine's CUDA (nixl-cu12 or nixl-cu13)"
        findings.append(Finding(BROKEN, f"NIXL has no UCX backend (plugins: {plugins})", fix))
    if memory == "cuda" and not _build_matches(probe):
        findings.append(
            Finding(
                SLOW,
                f"NIXL loads {probe.nixl_build}, built for another CUDA than this machine's "
                f"{probe.machine_cuda_major}: UCX's CUDA transports do not load, so VRAM moves over TCP",
                f"pip install nixl-cu{probe.machine_cuda_major}==1.5.1 (pdserve's gpu extra: pip install -e '.[gpu]')",
            )
        )
    if memory == "cuda" and (error := probe.ucx_module_errors.get("cuda")):
        findings.append(
            Finding(
                SLOW,
                f"UCX's CUDA module (cuda_copy, cuda_ipc) does not load here: {error}; UCX leaves it out without a "
                "word, so VRAM moves over TCP",
                "make the library it names loadable in the engines: the NVIDIA driver's libraries (libcuda, "
                "libnvidia-ml) in ldconfig's paths or on LD_LIBRARY_PATH in engine.env",
            )
        )
    if memory == "cuda" and "cuda" not in probe.ucx_modules:
        findings.append(Finding(SLOW, "the NIXL wheel's UCX has no CUDA module: VRAM moves over TCP",
                                "install nixl-cu12 or nixl-cu13, whose UCX carries libuct_cuda"))  # fmt: skip
    fast = [t for t in ucx if t != "tcp"]
    if not fast:
        findings.append(_tcp_finding(probe, place, memory, tls))
    return findings


def _tcp_finding(probe: HostProbe, place: Where, memory: str, tls: str | None) -> Finding:
    """Why UCX is left with TCP on this path, and the fix."""
    wider = ucx_path(probe, place, memory, None)
    if tls and any(t != "tcp" for t in wider):
        faster = ", ".join(t for t in wider if t != "tcp")
        return Finding(
            SLOW,
            f"UCX_TLS={tls} leaves UCX only TCP here, where it could use {faster}",
            "leave UCX_TLS out of engine.env (or name the faster transports in it); on the namespace test bed TCP "
            "is what its hosts can reach",
        )
    if place is Where.OTHER_NODE:
        return Finding(
            SLOW,
            "no RDMA device on this host (/sys/class/infiniband): UCX moves KV between nodes over TCP",
            "RDMA NICs (InfiniBand or RoCE) with their drivers; UCX_NET_DEVICES picks one (engine.env)",
        )
    return Finding(SLOW, "UCX is left only TCP on this node", "check UCX_TLS and the NIXL wheel's UCX modules")
