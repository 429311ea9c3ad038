"""The proxy's Prometheus metrics, served at ``GET /metrics``.

``ProxyMetrics(pool)`` holds one ``CollectorRegistry`` per app (built in
``create_app``, never a module global, so two apps in one process, as in the
tests, count apart):

- ``pdserve_proxy_requests_total{route,status,path}``: completion requests
  answered, by route (``/v1/chat/completions``...), HTTP status (499: the
  client went away first) and serving path (``request.state.serving_path``,
  ``disaggregated`` unless the router said otherwise). A stream counts when it ends.
- ``pdserve_proxy_requests_received_total``: completion requests arrived (the
  autoscaler's arrival rate: it counts a request when it comes, not when it ends).
- ``pdserve_proxy_time_to_first_token_seconds``: request arrival to the first
  streamed chunk relayed (streams only; a JSON answer has no first token to see).
- ``pdserve_proxy_inter_token_latency_seconds``: between streamed chunks.
- ``pdserve_proxy_e2e_request_latency_seconds``: arrival to the last byte handed on.
- ``pdserve_proxy_tier_lookups_total{outcome}``: what the shared KV tier holds of a
  prompt, asked of a tier engine before routing (``ok``; ``failed``: no answer in
  time, routed as without a tier).
- ``pdserve_proxy_engine_in_flight{role,engine_id}``: read from ``pool.snapshot()``
  when scraped, so the hot path pays nothing for it.
- ``pdserve_proxy_pool_engines{role,state}``: the pool's engines by state (``ready``:
  healthy and serving; ``ejected``: failing its health checks; ``draining``), and
  ``pdserve_proxy_pool_target{role}``: the size the cluster's controller wants (its
  autoscaler's decisions, ``pdserve scale``); a standalone proxy has no target.

Labelled children are bound once per label set and kept, so a request costs
a dict look-up, not ``labels()``; the histograms have no labels.

With ``pdserve proxy --workers N`` each worker process has its own registry
and a scrape reaches one of them (the kernel picks): see the README.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE_LATEST", "ProxyMetrics"]

DEFAULT_SERVING_PATH = "disaggregated"
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class ProxyMetrics:
    """The metrics of one app (see the module's docstring)."""

    def __init__(self, pool: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests = Counter(
            "pdserve_proxy_requests",
            "Completion requests answered, by route, HTTP status and serving path.",
            ("route", "status", "path"),
            registry=self.registry,
        )
        self.received = Counter(
            "pdserve_proxy_requests_received",
            "Completion requests arrived (counted on arrival, answered or not).",
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "pdserve_proxy_time_to_first_token_seconds",
            "From a streamed request's arrival to its first chunk relayed.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "pdserve_proxy_inter_token_latency_seconds",
            "Time between consecutive chunks of a stream.",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e_request_latency = Histogram(
            "pdserve_proxy_e2e_request_latency_seconds",
            "From a request's arrival to the end of its answer.",
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.degraded = Counter(
            "pdserve_proxy_degraded_requests",
            "Requests served by one engine alone because a pool could not take them, by reason "
            "(no-prefill-engine, prefill-failed: decode-only; no-decode-engine: on a prefill engine).",
            ("reason",),
            registry=self.registry,
        )
        self.tier_lookups = Counter(
            "pdserve_proxy_tier_lookups",
            "Lookups of what the shared KV tier holds of a prompt, before routing, by outcome (ok, failed).",
            ("outcome",),
            registry=self.registry,
        )
        self.registry.register(_EngineInFlight(pool))
        self.registry.register(_PoolSizes(pool))
        self._counters: dict[tuple[str, int, str], Any] = {}

    def request_done(self, route: str, status: int, serving_path: str, elapsed_s: float) -> None:
        key = (route, status, serving_path)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = self._requests.labels(route, str(status), serving_path)
        counter.inc()
        self.e2e_request_latency.observe(elapsed_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineInFlight(Collector):
    """``pdserve_proxy_engine_in_flight``, read from the pool at scrape time."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def collect(self):  # noqa: ANN201 (prometheus_client's signature)
        family = GaugeMetricFamily(
            "pdserve_proxy_engine_in_flight",
            "Requests this proxy process has under way on each engine.",
            labels=("role", "engine_id"),
        )
        for role, engines in self._pool.snapshot().items():
            for engine in engines:
                family.add_metric((role, engine["engine_id"]), engine.get("in_flight", 0))
        yield family

    def describe(self):  # noqa: ANN201
        return [GaugeMetricFamily("pdserve_proxy_engine_in_flight", "", labels=("role", "engine_id"))]


class _PoolSizes(Collector):
    """``pdserve_proxy_pool_engines`` and ``pdserve_proxy_pool_target``, read from the pool at scrape time."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def collect(self):  # noqa: ANN201
        engines = GaugeMetricFamily(
            "pdserve_proxy_pool_engines",
            "The pool's engines by state (ready, ejected, draining).",
            labels=("role", "state"),
        )
        target = GaugeMetricFamily(
            "pdserve_proxy_pool_target", "The pool's size as the cluster's controller wants it.", labels=("role",)
        )
        for role, members in self._pool.snapshot().items():
            states = ["draining" if e["draining"] else "ready" if e["healthy"] else "ejected" for e in members]
            for state in ("ready", "ejected", "draining"):
                engines.add_metric((role, state), states.count(state))
            if role in self._pool.targets:
                target.add_metric((role,), self._pool.targets[role])
        yield engines
        yield target

    def describe(self):  # noqa: ANN201
        return [
            GaugeMetricFamily("pdserve_proxy_pool_engines", "", labels=("role", "state")),
            GaugeMetricFamily("pdserve_proxy_pool_target", "", labels=("role",)),
        ]
