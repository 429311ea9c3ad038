"""The proxy's Prometheus metrics, served at ``GET /metrics``.

``ProxyMetrics(pools)`` holds one ``CollectorRegistry`` per app (built in
``create_app``, never a module global, so two apps in one process, as in the
tests, count apart). Every metric has a ``model`` label: the served model's
name (a request for an adapter counts for its model); ``ProxyMetrics.of(model)``
is what a model's flow counts in. A request refused before its body named a
model counts for the one model of an app that serves one, else as model "".

- ``pdserve_proxy_requests_total{model,route,status,path}``: completion requests
  answered, by route (``/v1/chat/completions``...), HTTP status (499: the
  client went away first) and serving path (``request.state.serving_path``,
  ``disaggregated`` unless the router said otherwise). A stream counts when it ends.
- ``pdserve_proxy_requests_received_total``: completion requests arrived (the
  autoscaler's arrival rate: it counts a request when it comes, once its body
  named a model, not when it ends).
- ``pdserve_proxy_time_to_first_token_seconds``: request arrival to the first
  streamed chunk relayed (streams only; a JSON answer has no first token to see).
- ``pdserve_proxy_inter_token_latency_seconds``: between streamed chunks.
- ``pdserve_proxy_e2e_request_latency_seconds``: arrival to the last byte handed on.
- ``pdserve_proxy_decode_migrations_total{model,outcome}``: requests whose decode
  leg moved off an engine that failed before it answered (``served``: another
  answered; ``failed``: none could).
- ``pdserve_proxy_tier_lookups_total{outcome}``: what the shared KV tier holds of a
  prompt, asked of a tier engine before routing (``ok``; ``failed``: no answer in
  time, routed as without a tier).
- ``pdserve_proxy_engine_in_flight{model,role,engine_id}``: read from each pool's
  ``snapshot()`` when scraped, so the hot path pays nothing for it.
- ``pdserve_proxy_pool_engines{model,role,state}``: the pool's engines by state (``ready``:
  healthy and serving; ``ejected``: failing its health checks; ``draining``), and
  ``pdserve_proxy_pool_target{model,role}``: the size the cluster's controller wants (its
  autoscaler's decisions, ``pdserve scale``); a standalone proxy has no target.

Labelled children are bound once per label set and kept (``ModelMetrics``), so
a request costs a dict look-up, not ``labels()``.

With ``pdserve proxy --workers N`` each worker process has its own registry
and a scrape reaches one of them (the kernel picks): see the README.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    """The metrics of one app (see the module's docstring): ``of(model)`` counts for one model."""

    def __init__(self, pools: Mapping[str, Any] | Any) -> None:
        """``pools``: each served model's ``EnginePool``, by name (or one pool: a model named "")."""
        self.pools: Mapping[str, Any] = pools if isinstance(pools, Mapping) else {"": pools}
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter(
            "pdserve_proxy_requests",
            "Completion requests answered, by model, route, HTTP status and serving path.",
            ("model", "route", "status", "path"),
            registry=registry,
        )
        self.received = Counter(
            "pdserve_proxy_requests_received",
            "Completion requests arrived, by model (counted once the body named it, answered or not).",
            ("model",),
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "pdserve_proxy_time_to_first_token_seconds",
            "From a streamed request's arrival to its first chunk relayed.",
            ("model",),
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "pdserve_proxy_inter_token_latency_seconds",
            "Time between consecutive chunks of a stream.",
            ("model",),
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e_request_latency = Histogram(
            "pdserve_proxy_e2e_request_latency_seconds",
            "From a request's arrival to the end of its answer.",
            ("model",),
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self.degraded = Counter(
            "pdserve_proxy_degraded_requests",
            "Requests served by one engine alone because a pool could not take them, by model and reason "
            "(no-prefill-engine, prefill-failed: decode-only; no-decode-engine: on a prefill engine).",
            ("model", "reason"),
            registry=registry,
        )
        self.migrations = Counter(
            "pdserve_proxy_decode_migrations",
            "Requests whose decode leg moved off an engine that failed before it answered (decode_retries), by "
            "model and outcome (served: another engine answered; failed: none could).",
            ("model", "outcome"),
            registry=registry,
        )
        self.tier_lookups = Counter(
            "pdserve_proxy_tier_lookups",
            "Lookups of what the shared KV tier holds of a prompt, before routing, by model and outcome (ok, failed).",
            ("model", "outcome"),
            registry=registry,
        )
        registry.register(_EngineInFlight(self.pools))
        registry.register(_PoolSizes(self.pools))
        self._models: dict[str, ModelMetrics] = {}

    def of(self, model: str | None) -> ModelMetrics:
        """The metrics of ``model``; None: of a request whose model is not known yet, which counts for the one
        model of an app that serves one, and as model "" in one that serves several."""
        if model is None:
            model = next(iter(self.pools)) if len(self.pools) == 1 else ""
        if model not in self._models:
            self._models[model] = ModelMetrics(self, model)
        return self._models[model]

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    """One model's children of ``ProxyMetrics``' metrics (bound once: a request costs a dict look-up)."""

    def __init__(self, metrics: ProxyMetrics, model: str) -> None:
        self.model = model
        self._requests = metrics.requests
        self.received = metrics.received.labels(model)
        self.time_to_first_token = metrics.time_to_first_token.labels(model)
        self.inter_token_latency = metrics.inter_token_latency.labels(model)
        self.e2e_request_latency = metrics.e2e_request_latency.labels(model)
        self.degraded = _Labelled(metrics.degraded, model)
        self.tier_lookups = _Labelled(metrics.tier_lookups, model)
        self.migrations = _Labelled(metrics.migrations, model)
        self._counters: dict[tuple[str, int, str], Any] = {}

    def request_done(self, route: str, status: int, serving_path: str, elapsed_s: float) -> None:
        key = (route, status, serving_path)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = self._requests.labels(self.model, route, str(status), serving_path)
        counter.inc()
        self.e2e_request_latency.observe(elapsed_s)


class _Labelled:
    """A labelled metric whose first label (the model) is given: ``labels(reason)``."""

    def __init__(self, metric: Any, model: str) -> None:
        self._metric, self._model = metric, model

    def labels(self, *values: str) -> Any:
        return self._metric.labels(self._model, *values)


class _EngineInFlight(Collector):
    """``pdserve_proxy_engine_in_flight``, read from the pools at scrape time."""

    def __init__(self, pools: Mapping[str, Any]) -> None:
        self._pools = pools

    def collect(self):  # noqa: ANN201 (prometheus_client's signature)
        family = GaugeMetricFamily(
            "pdserve_proxy_engine_in_flight",
            "Requests this proxy process has under way on each engine.",
            labels=("model", "role", "engine_id"),
        )
        for model, pool in self._pools.items():
            for role, engines in pool.snapshot().items():
                for engine in engines:
                    family.add_metric((model, role, engine["engine_id"]), engine.get("in_flight", 0))
        yield family

    def describe(self):  # noqa: ANN201
        return [GaugeMetricFamily("pdserve_proxy_engine_in_flight", "", labels=("model", "role", "engine_id"))]


class _PoolSizes(Collector):
    """``pdserve_proxy_pool_engines`` and ``pdserve_proxy_pool_target``, read from the pool at scrape time."""

    def __init__(self, pools: Mapping[str, Any]) -> None:
        self._pools = pools

    def collect(self):  # noqa: ANN201
        engines = GaugeMetricFamily(
            "pdserve_proxy_pool_engines",
            "The pool's engines by state (ready, ejected, draining).",
            labels=("model", "role", "state"),
        )
        target = GaugeMetricFamily(
            "pdserve_proxy_pool_target",
            "The pool's size as the cluster's controller wants it.",
            labels=("model", "role"),
        )
        for model, pool in self._pools.items():
            for role, members in pool.snapshot().items():
                states = ["draining" if e["draining"] else "ready" if e["healthy"] else "ejected" for e in members]
                for state in ("ready", "ejected", "draining"):
                    engines.add_metric((model, role, state), states.count(state))
                if role in pool.targets:
                    target.add_metric((model, role), pool.targets[role])
        yield engines
        yield target

    def describe(self):  # noqa: ANN201
        return [
            GaugeMetricFamily("pdserve_proxy_pool_engines", "", labels=("model", "role", "state")),
            GaugeMetricFamily("pdserve_proxy_pool_target", "", labels=("model", "role")),
        ]
