"""Turn a ClusterSpec into per-engine launch plans (pure: no Ray, no vLLM).

Each ``EngineLaunch`` says everything one engine actor needs: its id and role,
the vLLM server flags (the role decides ``--kv-transfer-config``), the
environment (CPU core pinning, KV cache size, NIXL side-channel port) and the
Ray resources it asks for. On CPU, engines are given disjoint core ranges in
order (prefill-0, prefill-1, ..., decode-0, ...): two unpinned vLLM CPU
engines on one machine thrash each other (see ENVIRONMENT.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from orchestrator.models import resolve_dtype, resolve_model
from orchestrator.spec import ClusterSpec
from proxy.pool import ROLES


@dataclass(frozen=True, slots=True)
class EngineLaunch:
    engine_id: str
    role: str
    host: str
    port: int
    kv_port: int
    vllm_args: list[str]
    env: dict[str, str]
    num_cpus: float
    num_gpus: float
    cpu_bind: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def kv_transfer_config(
    spec: ClusterSpec,
    role: str,
    *,
    host: str = "127.0.0.1",
    kv_port: int | None = None,
    engine_id: str | None = None,
) -> dict[str, Any]:
    """The vLLM ``--kv-transfer-config`` of an engine in ``role``.

    Both roles are ``kv_both`` (as vLLM's NIXL examples do): whether an
    engine produces or consumes KV is decided per request by the
    ``kv_transfer_params`` the proxy sends. Our own connector (``pdserve``)
    learns its side channel from ``kv_connector_extra_config``, so it needs
    the engine's ``host`` and ``kv_port``; it also takes pdserve's
    ``engine_id`` as vLLM's, so per-request KV reports name the engine a user
    sees in ``pdserve status``. (vLLM's NixlConnector keeps its random id: it
    caches peers by id, and a restarted engine must not look like a known one.
    Ours forgets a peer whose read failed and handshakes again.)
    """
    buffer_device = "cpu" if spec.device == "cpu" else "cuda"
    if spec.connector == "vllm-nixl":
        return {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": buffer_device,
            # A failed KV read makes the decode engine recompute the prompt
            # instead of failing the request with HTTP 500.
            "kv_load_failure_policy": "recompute",
        }
    if spec.connector == "pdserve":
        if kv_port is None:
            raise ValueError(f"connector 'pdserve' needs the {role} engine's kv_port for its side channel")
        return {
            **({"engine_id": engine_id} if engine_id else {}),
            "kv_connector": "PdserveConnector",
            "kv_connector_module_path": "connectors.vllm_connector",
            "kv_role": "kv_both",
            "kv_buffer_device": buffer_device,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "side_channel_host": host,
                "side_channel_port": kv_port,
                **spec.pdserve_connector.model_dump(),
            },
        }
    raise ValueError(f"unknown connector {spec.connector!r}")


def flag_args(options: dict[str, Any]) -> list[str]:
    """``{max_num_seqs: 8, enable_prefix_caching: False}`` -> vLLM CLI flags."""
    args: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is None:  # `key: null` in YAML: leave vLLM's default
            continue
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, dict | list):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args


def _core_ranges(spec: ClusterSpec) -> dict[str, str]:
    """Disjoint OpenMP core bindings per engine; TP ranks separated by '|'."""
    bindings: dict[str, str] = {}
    next_core = 0
    # Only with resources.share_cores can engines need more cores than there are: they wrap around.
    available = spec.cpu_cores_available
    for role in ROLES:
        pool = spec.pool(role)
        for replica in range(spec.max_replicas(role)):
            ranks = []
            for _ in range(pool.tensor_parallel_size):
                cores = [(next_core + i) % available for i in range(pool.cpu_cores)]
                contiguous = cores == list(range(cores[0], cores[-1] + 1))
                ranks.append(f"{cores[0]}-{cores[-1]}" if contiguous and len(cores) > 1 else ",".join(map(str, cores)))
                next_core += pool.cpu_cores
            bindings[f"{role}-{replica}"] = "|".join(ranks)
    return bindings


def plan_engines(spec: ClusterSpec, host: str = "127.0.0.1") -> list[EngineLaunch]:
    """How to launch every engine the cluster may run: ``spec.max_replicas(role)`` per pool, in
    replica order (the first ``replicas`` of each pool start with the cluster)."""
    model_path = resolve_model(spec.model)
    bindings = _core_ranges(spec) if spec.device == "cpu" else {}
    launches = []
    for role in ROLES:
        pool = spec.pool(role)
        count = spec.max_replicas(role)
        for replica, (port, kv_port) in enumerate(zip(pool.ports(count), pool.kv_ports(count), strict=True)):
            engine_id = f"{role}-{replica}"
            transfer_config = kv_transfer_config(spec, role, host=host, kv_port=kv_port, engine_id=engine_id)
            args = [
                "--model", model_path,
                "--served-model-name", spec.model_name,
                "--host", host,
                "--port", str(port),
                "--max-model-len", str(spec.engine.max_model_len),
                "--dtype", resolve_dtype(spec.model, spec.engine.dtype),
                "--tensor-parallel-size", str(pool.tensor_parallel_size),
                "--kv-transfer-config", json.dumps(transfer_config),
                "--disable-uvicorn-access-log",
            ]  # fmt: skip
            if spec.engine.enforce_eager:
                args.append("--enforce-eager")
            env = {
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(kv_port),
                "VLLM_NIXL_SIDE_CHANNEL_HOST": host,
                "VLLM_USAGE_STATS_DISABLED": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "HF_HUB_OFFLINE": "1" if model_path.startswith("/") else "0",
            }
            if spec.device == "cpu":
                env["VLLM_CPU_OMP_THREADS_BIND"] = bindings[engine_id]
                env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.engine.kv_cache_gib)
                cpus, gpus = float(pool.tensor_parallel_size * pool.cpu_cores), 0.0
            else:
                args += ["--gpu-memory-utilization", str(spec.engine.gpu_memory_utilization)]
                cpus, gpus = 1.0, float(pool.tensor_parallel_size)
            args += flag_args(spec.engine.extra_args)
            launches.append(
                EngineLaunch(
                    engine_id=engine_id,
                    role=role,
                    host=host,
                    port=port,
                    kv_port=kv_port,
                    vllm_args=args,
                    env=env,
                    num_cpus=cpus,
                    num_gpus=gpus,
                    cpu_bind=bindings.get(engine_id),
                )
            )
    return launches
