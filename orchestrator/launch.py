"""Turn a ClusterSpec into per-engine launch plans (pure: no Ray, no vLLM).

Each ``EngineLaunch`` says everything one engine actor needs: its id and role,
the vLLM server flags (the role decides ``--kv-transfer-config``), the
environment (CPU core pinning, KV cache size, NIXL side-channel port) and the
Ray resources and placement it asks for. On CPU, the engines that may share
hosts (pools with the same placement) are given disjoint core ranges in order
(prefill-0, prefill-1, ..., decode-0, ...) from their pool's ``first_core``:
two unpinned vLLM CPU engines on one machine thrash each other (see
ENVIRONMENT.md). Pools placed on different hosts each have their own plan.

An engine's address: on a local cluster ``127.0.0.1``; on a joined Ray cluster
the plan leaves ``host`` unset and the engine actor resolves, on its node, the
address other hosts reach it at (``orchestrator.address``), then takes
``launch.on_host(...)``: the same launch with that address in vLLM's
``--host`` and in the connector's side channel.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from connectors.tier import TIER_HASH_ALGO
from connectors.vllm_plugin import CALM_NIXL_ENV, FORK_WORKERS_ENV
from contract import wire
from contract.wire import LISTEN_ALL, ROLES, http_url, side_channel_endpoints
from orchestrator import placement
from orchestrator.models import resolve_dtype, resolve_model
from orchestrator.placement import Placement, engine_placement
from orchestrator.spec import ClusterSpec

LOCAL_HOST = "127.0.0.1"
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class EngineLaunch:
    engine_id: str
    role: str
    host: str | None
    """The address peers reach this engine at; None until the engine resolves it on its node."""
    port: int
    kv_port: int
    vllm_args: list[str]
    env: dict[str, str]
    num_cpus: float
    num_gpus: float
    cpu_bind: str | None = None
    tp_size: int = 1
    placement: Placement = dataclasses.field(default_factory=Placement)
    bind: str | None = None
    """Where its HTTP server listens, when not ``host`` (``network.listen_all``: 0.0.0.0)."""
    model: str = ""
    """The served name of its model (``ClusterSpec.model_name`` of its view)."""

    @property
    def url(self) -> str:
        if self.host is None:
            raise ValueError(f"engine {self.engine_id} has not resolved its address yet")
        return http_url(self.host, self.port)

    @property
    def kv_endpoints(self) -> tuple[str, ...]:
        """Its connector's side channel, one endpoint per TP rank (``contract.wire``)."""
        if self.host is None:
            raise ValueError(f"engine {self.engine_id} has not resolved its address yet")
        return side_channel_endpoints(self.host, self.kv_port, self.tp_size)

    @property
    def serves_our_side_channel(self) -> bool:
        """Whether its connector is ours (it answers on ``kv_endpoints``), alone or inside the tier's."""
        if "--kv-transfer-config" not in self.vllm_args:
            return False
        return any(_our_connector_configs(json.loads(self.vllm_args[self.vllm_args.index("--kv-transfer-config") + 1])))

    def on_host(self, host: str, bind: str | None = None) -> EngineLaunch:
        """This launch at ``host`` (advertised to peers; vLLM listens at ``bind``, default ``host``)."""
        args = list(self.vllm_args)
        args[args.index("--host") + 1] = bind or host
        config_at = args.index("--kv-transfer-config") + 1
        config = json.loads(args[config_at])
        for ours in _our_connector_configs(config):
            ours["side_channel_host"] = host
        args[config_at] = json.dumps(config)
        env = {**self.env, "VLLM_NIXL_SIDE_CHANNEL_HOST": host}
        return dataclasses.replace(self, host=host, bind=bind, vllm_args=args, env=env)


def _our_connector_configs(kv_transfer_config: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``kv_connector_extra_config`` of each of our connectors in a ``--kv-transfer-config``: the config's
    own, or one inside the tier's MultiConnector (ours is the one with a side channel)."""
    extra = kv_transfer_config.get("kv_connector_extra_config", {})
    children = [kv_transfer_config, *extra.get("connectors", ())]
    return [
        c["kv_connector_extra_config"]
        for c in children
        if "side_channel_host" in c.get("kv_connector_extra_config", {})
    ]


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
        ours = {
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
        if spec.kv_tier is None or role not in spec.kv_tier.pools:
            return ours
        return with_kv_tier(spec, ours)
    raise ValueError(f"unknown connector {spec.connector!r}")


def with_kv_tier(spec: ClusterSpec, ours: dict[str, Any]) -> dict[str, Any]:
    """``ours`` beside vLLM's ``OffloadingConnector`` with the tier (``connectors.tier``), in our MultiConnector.

    Ours comes first: on a decode engine it loads a remote prefill's KV; where it has
    nothing to load (the prefill leg, a decode-only request) the tier serves the prompt's
    stored prefix. Both keep what they need when a request finishes. The engine id is the
    MultiConnector's, which its children inherit.
    """
    tier = spec.kv_tier
    assert tier is not None
    node, shared = spec.kv_tier_paths()
    secondary = [
        {"type": "PdserveFsTier", "module_path": "connectors.tier.fs_tier", "name": name, "root_dir": str(path),
         "max_bytes": int(gib * GIB), "fsync": tier.fsync and name == wire.SHARED_TIER,
         "async_lookup": tier.async_lookup and name == wire.SHARED_TIER}
        for name, path, gib in (("node", node, tier.node_gib), (wire.SHARED_TIER, shared, tier.shared_gib))
        if path is not None
    ]  # fmt: skip
    child = {key: value for key, value in ours.items() if key != "engine_id"}
    offloading = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "PdserveTierSpec",
            "spec_module_path": "connectors.tier.spec",
            "cpu_bytes_to_use": int(tier.host_gib * GIB),
            # also the blocks of the answer: a conversation's next prompt repeats it (vLLM stores prompts only)
            "offload_prompt_only": False,
            "secondary_tiers": secondary,
        },
    }
    return {
        **({"engine_id": ours["engine_id"]} if "engine_id" in ours else {}),
        "kv_connector": "PdserveMultiConnector",
        "kv_connector_module_path": "connectors.tier.multi",
        "kv_role": "kv_both",
        "kv_buffer_device": ours["kv_buffer_device"],
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": [child, offloading]},
    }


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
    """Disjoint OpenMP core bindings per engine, one plan per group of pools that may share hosts;
    TP ranks separated by '|'."""
    bindings: dict[str, str] = {}
    for roles in placement.placement_domains(spec).values():
        bindings.update(host_core_ranges(spec, roles))
    return bindings


def host_core_ranges(spec: ClusterSpec, roles: tuple[str, ...]) -> dict[str, str]:
    """The engines that start with the cluster are planned first, so that they get cores of their own
    whenever there are enough; the replicas only an autoscaler or ``pdserve scale`` may add come after.
    Engines get consecutive cores while the machine has them; after that (``resources.share_cores``) a
    rank goes where the fewest ranks of its own pool run, then the fewest of any: a second prefill engine
    on the first one's core would add no prefill compute. Planned by replica order instead, the
    autoscaling demo (prefill 1..2, decode 1, two cores) would run prefill-0 and decode-0 on core 0 while
    core 1 waits for a prefill-1 that may never start."""
    bindings: dict[str, str] = {}
    available = placement.cpu_cores_available(spec)
    next_core = 0
    total = [0] * available
    own = {role: [0] * available for role in roles}
    for starting in (True, False):
        for role in roles:
            pool = spec.pool(role)
            if starting:
                next_core = max(next_core, pool.placement.first_core)
            width = min(pool.cpu_cores, available)
            replicas = range(pool.replicas) if starting else range(pool.replicas, spec.max_replicas(role))
            for replica in replicas:
                ranks = []
                for _ in range(pool.tensor_parallel_size):
                    if next_core + width <= available:  # free cores left: the next ones
                        first, next_core = next_core, next_core + width
                    else:  # shared: the fewest of this pool's ranks, then of all, then the lowest core
                        first = min(
                            range(available),
                            key=lambda c: (
                                sum(own[role][(c + i) % available] for i in range(width)),
                                sum(total[(c + i) % available] for i in range(width)),
                                c,
                            ),
                        )
                    cores = [(first + i) % available for i in range(width)]
                    for core in cores:
                        total[core] += 1
                        own[role][core] += 1
                    contiguous = cores == list(range(cores[0], cores[-1] + 1))
                    ranks.append(
                        f"{cores[0]}-{cores[-1]}" if contiguous and len(cores) > 1 else ",".join(map(str, cores))
                    )
                bindings[spec.engine_id(role, replica)] = "|".join(ranks)
    return bindings


def plan_engines(spec: ClusterSpec, host: str | None = LOCAL_HOST) -> list[EngineLaunch]:
    """How to launch every engine the cluster may run: ``spec.max_replicas(role)`` per pool, in
    replica order (the first ``replicas`` of each pool start with the cluster), model after model.
    ``host`` None: each engine resolves its address where it lands (``EngineLaunch.on_host``)."""
    return [launch for view in spec.views() for launch in _plan_model(view, host)]


def _plan_model(spec: ClusterSpec, host: str | None) -> list[EngineLaunch]:
    model_path = resolve_model(spec.model)
    planned_host = host or LOCAL_HOST  # a stand-in until the engine resolves its own
    bindings = _core_ranges(spec) if spec.device == "cpu" else {}
    launches = []
    for role in ROLES:
        pool = spec.pool(role)
        count = spec.max_replicas(role)
        for replica, (port, kv_port) in enumerate(zip(pool.ports(count), pool.kv_ports(count), strict=True)):
            engine_id = spec.engine_id(role, replica)
            transfer_config = kv_transfer_config(spec, role, host=planned_host, kv_port=kv_port, engine_id=engine_id)
            args = [
                "--model", model_path,
                "--served-model-name", spec.model_name,
                "--host", planned_host,
                "--port", str(port),
                "--max-model-len", str(spec.engine.max_model_len),
                "--dtype", resolve_dtype(spec.model, spec.engine.dtype),
                "--tensor-parallel-size", str(pool.tensor_parallel_size),
                "--kv-transfer-config", json.dumps(transfer_config),
                "--disable-uvicorn-access-log",
            ]  # fmt: skip
            if spec.engine.enforce_eager:
                args.append("--enforce-eager")
            if spec.engine.tool_call_parser is not None:  # both pools: the decode engine parses what it generates
                args += ["--enable-auto-tool-choice", "--tool-call-parser", spec.engine.tool_call_parser]
            if adapters := spec.engine.lora_adapters:  # both pools: the KV of an adapter's prompt is the adapter's
                args += ["--enable-lora", "--max-loras", str(spec.engine.max_loras)]
                args += ["--max-lora-rank", str(spec.engine.max_lora_rank)]
                args += ["--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]
            if spec.engine.chat_template is not None:  # both pools render the prompt alike, or their KV differs
                args += ["--chat-template", spec.engine.chat_template]
            if spec.kv_tier is not None:
                # block hashes name the tier's entries: every engine must compute the same ones
                args += ["--prefix-caching-hash-algo", TIER_HASH_ALGO]
            env = {
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(kv_port),
                "VLLM_NIXL_SIDE_CHANNEL_HOST": planned_host,
                "VLLM_USAGE_STATS_DISABLED": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "HF_HUB_OFFLINE": "1" if model_path.startswith("/") else "0",
            }
            env.update(spec.engine.env)
            if spec.device == "cpu":
                env["VLLM_CPU_OMP_THREADS_BIND"] = bindings[engine_id]
                env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.engine.kv_cache_gib)
                # connectors.vllm_plugin: the engine core forks its workers; vLLM's NIXL thread sleeps (it
                # would spin the engine's core). engine.env may turn either off ("0").
                env.setdefault(FORK_WORKERS_ENV, "1")
                if spec.connector == "vllm-nixl":
                    env.setdefault(CALM_NIXL_ENV, "1")
                if spec.engine.enforce_eager:
                    # vLLM still torch.compiles two sampler helpers; an engine's first logprobs request compiled
                    # one (dynamo, inductor, C++) for 13-16 s here. Eager, as the model runs: 2.7 s.
                    env.setdefault("TORCHDYNAMO_DISABLE", "1")
                cpus, gpus = float(pool.tensor_parallel_size * pool.cpu_cores), 0.0
            else:
                args += ["--gpu-memory-utilization", str(spec.engine.gpu_memory_utilization)]
                # vLLM's Ray executor runs the TP workers in the engine's placement group bundles.
                args += ["--distributed-executor-backend", "ray"]
                cpus, gpus = 0.0, float(pool.tensor_parallel_size)
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
                    tp_size=pool.tensor_parallel_size,
                    placement=engine_placement(spec, role),
                    bind=LISTEN_ALL[0] if spec.network.listen_all else None,
                    model=spec.model_name,
                )
            )
    return launches
