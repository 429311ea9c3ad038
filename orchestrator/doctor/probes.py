"""What this host offers the KV path: NIXL's build and backends, the UCX transports beneath it, RDMA devices,
GPUs and their peer access (``probe_host``). Each probe says what it found or why it could not look; none fails."""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Gpu", "HostProbe", "probe_host"]

UCX_BUILT_IN = ("self", "tcp", "posix", "sysv")
"""UCX transports of its core library: every build has them (shared memory: posix, sysv)."""


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    uuid: str


@dataclass(frozen=True)
class HostProbe:
    """One host's answers; ``problems`` says what could not be probed and why."""

    node: str = ""
    nixl_build: str | None = None
    """The NIXL wheel ``import nixl`` loads (nixl_cu12, nixl_cu13), or None: NIXL is not importable."""
    nixl_version: str | None = None
    nixl_plugins: tuple[str, ...] = ()
    ucx_modules: tuple[str, ...] = ()
    """UCX's loadable transport modules of that build (cma: shared memory between processes, cuda: cuda_copy
    and cuda_ipc, ib: RDMA, ...), besides ``UCX_BUILT_IN``."""
    ucx_module_errors: dict[str, str] = field(default_factory=dict)
    """Modules of ``ucx_modules`` that do not load here, with the loader's reason (a library they need is missing,
    for one): UCX skips them without a word, and its transports are gone."""
    machine_cuda_major: int | None = None
    """The CUDA major the machine's driver or runtime says (NIXL picks its wheel by it), None without CUDA."""
    ucx_tls: str | None = None
    """``UCX_TLS`` of this process's environment."""
    rdma_devices: tuple[str, ...] = ()
    gpus: tuple[Gpu, ...] = ()
    peer_access: tuple[tuple[bool, ...], ...] = ()
    """``peer_access[i][j]``: GPU i can map GPU j's memory (CUDA peer access)."""
    visible_devices: str | None = None
    """``CUDA_VISIBLE_DEVICES`` of this process."""
    problems: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict:
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        data["gpus"] = [gpu.__dict__ for gpu in self.gpus]
        return data


def probe_host(with_gpus: bool = True) -> HostProbe:
    """Probe this host (``with_gpus``: ask torch about GPUs, which imports it)."""
    from connectors.transport import node_identity

    problems: list[str] = []
    build, version, plugins, modules, cuda_major, module_errors = _nixl(problems)
    gpus, peers = _gpus(problems) if with_gpus else ((), ())
    rdma = Path("/sys/class/infiniband")
    return HostProbe(
        node=node_identity(),
        nixl_build=build,
        nixl_version=version,
        nixl_plugins=plugins,
        ucx_modules=modules,
        ucx_module_errors=module_errors,
        machine_cuda_major=cuda_major,
        ucx_tls=os.environ.get("UCX_TLS"),
        rdma_devices=tuple(sorted(p.name for p in rdma.iterdir())) if rdma.is_dir() else (),
        gpus=gpus,
        peer_access=peers,
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        problems=tuple(problems),
    )


def _nixl(
    problems: list[str],
) -> tuple[str | None, str | None, tuple[str, ...], tuple[str, ...], int | None, dict[str, str]]:
    cuda_major = None
    try:
        from nixl_meta_utils import detect_cuda_major

        cuda_major = detect_cuda_major()
    except Exception as e:  # noqa: BLE001 - a probe reports, it never fails
        problems.append(f"cannot ask NIXL which CUDA this machine has: {e}")
    try:
        import nixl
    except Exception as e:  # noqa: BLE001
        problems.append(f"NIXL is not importable: {type(e).__name__}: {e}")
        return None, None, (), (), cuda_major, {}
    build = getattr(getattr(nixl, "_pkg", None), "__name__", None)
    try:
        version = importlib.metadata.version("nixl")
    except importlib.metadata.PackageNotFoundError:
        version = None
    plugins: tuple[str, ...] = ()
    try:
        from connectors.transport.nixl import make_agent

        agent, _ = make_agent(f"pdserve-doctor-{os.getpid()}", [], 0, "thread", 0)
        plugins = tuple(sorted(agent.get_plugin_list()))
    except Exception as e:  # noqa: BLE001
        problems.append(f"cannot start a NIXL agent: {type(e).__name__}: {e}")
    modules: tuple[str, ...] = ()
    errors: dict[str, str] = {}
    if build is not None:
        libs = Path(sys.modules[build].__file__ or "").parent.parent / f"{build}.libs" / "ucx"
        if libs.is_dir():
            found = {m[1]: p for p in libs.iterdir() if (m := re.fullmatch(r"libuct_(\w+)\.so[.\d]*", p.name))}
            modules = tuple(sorted(found))
            errors = {name: error for name, path in found.items() if (error := loads(path)) is not None}
        else:
            problems.append(f"no UCX modules found beside {build} (looked in {libs})")
    return build, version, plugins, modules, cuda_major, errors


def loads(path: Path) -> str | None:
    """Why the shared library at ``path`` does not load here (a library it needs is missing, say), or None."""
    import ctypes

    try:
        ctypes.CDLL(str(path), mode=os.RTLD_LAZY | os.RTLD_LOCAL)
    except OSError as e:
        return str(e)
    return None


def _gpus(problems: list[str]) -> tuple[tuple[Gpu, ...], tuple[tuple[bool, ...], ...]]:
    try:
        import torch

        if not torch.cuda.is_available():
            return (), ()
        count = torch.cuda.device_count()
        gpus = tuple(
            Gpu(i, torch.cuda.get_device_name(i), str(torch.cuda.get_device_properties(i).uuid)) for i in range(count)
        )
        peers = tuple(
            tuple(i == j or torch.cuda.can_device_access_peer(i, j) for j in range(count)) for i in range(count)
        )
        return gpus, peers
    except Exception as e:  # noqa: BLE001
        problems.append(f"cannot ask torch about GPUs: {type(e).__name__}: {e}")
        return (), ()
