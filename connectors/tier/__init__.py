"""The KV tier: prompt KV blocks kept outside the engines' caches, reused across requests and engines.

vLLM's offloading machinery does the bookkeeping (``OffloadingConnector``, its
scheduler, ``TieringOffloadingManager`` with a host-memory primary tier and
secondary tiers); what it lacks on CPU engines, and what the shared tier needs
beyond its ``fs`` tier, lives here:

- ``connectors.tier.spec``: ``PdserveTierSpec`` and a worker that copies blocks
  between the engine's KV cache and the host tier on CPU (vLLM's own worker is
  CUDA/XPU only).
- ``connectors.tier.store``: the shared filesystem tier: MAC'd, private, crash-safe
  entries, bounded by bytes with LRU eviction, with metrics.
- ``connectors.tier.key``: the filesystem tier's own MAC key, made once and kept in
  its directory, readable only by its owner: the tier outlives the cluster.
- ``connectors.tier.cleanup``: namespaces of older entry formats and keys, removed
  when a tier opens.
- ``connectors.tier.held``: how many of a request's prompt tokens the filesystem
  tiers hold, answered by the engine's HTTP server for the proxy's routing.
"""

TIER_HASH_ALGO = "sha256_cbor"
"""The block hash every engine with the tier computes (``--prefix-caching-hash-algo``): it names the
tier's entries, so it must be reproducible across processes and hosts (vLLM's documented choice)."""

REGION_ENV = "PDSERVE_KV_REGION"
"""Names an engine's host tier region (``/dev/shm/vllm_offload_<name>.mmap``). vLLM names it by engine
id, which two clusters on one machine share (``prefill-0``): one would join the other's region. The
engine actor sets a name of its own start (``orchestrator.engine_actor``)."""


def region_file(name: str) -> str:
    """Where vLLM's ``SharedOffloadRegion`` keeps the host region ``name``."""
    return f"/dev/shm/vllm_offload_{name}.mmap"


LAYOUT_ENV = "PDSERVE_KV_TIER_LAYOUTS"
"""A directory where each filesystem tier of the engine writes how its entries are named (``<tier>.json``):
the engine core knows it, and the engine's HTTP server, a process of its own, reads it to answer what the
tiers hold (``connectors.tier.held``). Set by the engine actor for each start."""
