"""The autoscaler on a running cluster: observe, decide, act, every ``interval_s``.

The controller (``orchestrator.controller``) runs ``Autoscaler.run`` next to its
engine monitor when the spec has an ``autoscaling`` section with a ``profile``.
Every ``interval_s`` it

1. scrapes ``/metrics`` of the proxy and of every engine (Prometheus text);
2. turns the readings into a ``ClusterObservation`` (``Observer``, pure: the
   differences between this reading and the last one of the same endpoint):

   - arrival rate: ``pdserve_proxy_requests_received_total`` per second;
   - p90 TTFT and inter-token latency: the proxy's histograms over the window,
     interpolated within a bucket as Prometheus' ``histogram_quantile`` does
     (streamed requests only: a JSON answer has no first token to time);
   - mean prompt tokens: the prefill engines' ``vllm:prompt_tokens_total`` per
     finished request (the decode engines' when only decode-only requests ran);
     mean output tokens: the decode engines' ``vllm:generation_tokens_total`` (every
     token generated in the window, running requests' too) per finished request;
     the last known means hold through a window without any;
   - the spread of prompt lengths (variance / mean^2) from the same engines'
     ``vllm:request_prompt_tokens`` histogram, each bucket at its middle;
   - per pool: engines serving and starting (the controller's records), requests
     waiting and running and the KV-cache use (the engines' own gauges);

3. asks the policy (``orchestrator.autoscale.policy``) for both pools' sizes;
4. records the decision with its reasons (``pdserve status`` shows the last
   ones, and the last ones that changed a pool) and, when a size changed, calls the controller's ``scale``, which starts
   engines or drains them exactly as ``pdserve scale`` does.

The first decision comes one interval after the cluster is ready: the first
reading is only the baseline the next one is compared with. An engine's first
reading is its baseline too, and a counter that went down (the engine restarted)
counts from zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from contract.errors import UnsafeDirectory
from contract.private_files import make_private_dirs, read_private, write_private
from contract.wire import ROLES
from orchestrator.autoscale.config import AutoscalingConfig
from orchestrator.autoscale.forecast import Season, forecaster_of
from orchestrator.autoscale.observation import ClusterObservation, PoolObservation, ScalingDecision
from orchestrator.autoscale.policy import AutoscalePolicy
from orchestrator.autoscale.profile import PerformanceProfile
from orchestrator.engine_metrics import MetricsReading, fetch_metrics

logger = logging.getLogger(__name__)

__all__ = ["Autoscaler", "EngineReading", "Observer", "histogram_cv2", "histogram_quantile"]

AUTOSCALER_REASON = "autoscaler"  # how the autoscaler's scale calls begin their reason (the others are by hand)
RECEIVED = "pdserve_proxy_requests_received_total"
PROXY_TTFT = "pdserve_proxy_time_to_first_token_seconds"
PROXY_ITL = "pdserve_proxy_inter_token_latency_seconds"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
OUTPUT_TOKENS = "vllm:generation_tokens_total"
PROMPT_LENGTHS = "vllm:request_prompt_tokens"  # histogram: the spread of prompt lengths
FINISHED = "vllm:request_success_total"
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
SCRAPE_TIMEOUT_S = 5.0
DECISIONS_KEPT = 20


def _increase(now: float, before: float | None) -> float:
    """A counter's increase since ``before``; a counter that went down restarted from 0."""
    if before is None:
        return 0.0
    return now - before if now >= before else now


def histogram_quantile(q: float, now: dict[float, float], before: dict[float, float]) -> float | None:
    """The ``q`` quantile of the observations between two readings of a histogram's cumulative buckets.

    Linear within the bucket it falls in (the lower edge of the first bucket is 0);
    a quantile in the ``+Inf`` bucket is the largest finite edge. None without observations.
    """
    edges = sorted(now)
    counts = [_increase(now[le], before.get(le, 0.0)) for le in edges]
    if not edges or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for le, count in zip(edges, counts, strict=True):
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def histogram_cv2(now: dict[float, float], before: dict[float, float]) -> float | None:
    """Variance / mean^2 of the observations between two readings of a histogram's cumulative buckets,
    each taken at its bucket's middle (the ``+Inf`` bucket's at its lower edge). None without observations."""
    lower, below, total, first, second = 0.0, 0.0, 0.0, 0.0, 0.0
    for le in sorted(now):
        count = _increase(now[le], before.get(le, 0.0))
        n = count - below
        value = lower if math.isinf(le) else (lower + le) / 2
        total, first, second = total + n, first + n * value, second + n * value * value
        lower, below = le, count
    if total <= 0 or first <= 0:
        return None
    mean = first / total
    return max(second / total / (mean * mean) - 1.0, 0.0)


@dataclass(slots=True, frozen=True)
class EngineReading:
    """An engine as the controller knows it, with its ``/metrics`` (None: it did not answer)."""

    engine_id: str
    role: str
    state: str  # the controller's: pending | starting | ready | restarting | draining ...
    metrics: MetricsReading | None


STARTING_STATES = ("pending", "starting", "restarting", "moving")  # provisioned, not serving yet (in its pool)


class Observer:
    """Readings in, ``ClusterObservation`` out: differences against the previous reading of each endpoint."""

    def __init__(self) -> None:
        self._proxy: MetricsReading | None = None
        self._engines: dict[str, MetricsReading] = {}
        self._t: float | None = None
        self.mean_prompt_tokens = 1.0
        self.mean_output_tokens = 1.0
        self.prompt_tokens_cv2 = 1.0

    def observe(
        self, t: float, proxy: MetricsReading | None, engines: Iterable[EngineReading], clock_s: float | None = None
    ) -> ClusterObservation:
        engines = list(engines)
        window = max(t - self._t, 1e-9) if self._t is not None else None
        before_proxy = self._proxy
        arrivals = 0.0
        ttft = itl = None
        if proxy is not None:
            if before_proxy is not None:
                arrivals = _increase(proxy.get(RECEIVED), before_proxy.get(RECEIVED))
                ttft = histogram_quantile(
                    0.9, proxy.buckets.get(PROXY_TTFT, {}), before_proxy.buckets.get(PROXY_TTFT, {})
                )
                itl = histogram_quantile(0.9, proxy.buckets.get(PROXY_ITL, {}), before_proxy.buckets.get(PROXY_ITL, {}))
            self._proxy = proxy
        self._update_means(engines)
        for e in engines:
            if e.metrics is not None:
                self._engines[e.engine_id] = e.metrics
        self._t = t
        pools = {role: self._pool([e for e in engines if e.role == role], role) for role in ROLES}
        return ClusterObservation(
            t=t,
            arrival_rate_rps=arrivals / window if window else 0.0,
            mean_prompt_tokens=self.mean_prompt_tokens,
            mean_output_tokens=self.mean_output_tokens,
            prefill=pools["prefill"],
            decode=pools["decode"],
            ttft_p90_s=ttft,
            itl_p90_s=itl,
            prompt_tokens_cv2=self.prompt_tokens_cv2,
            clock_s=clock_s,
        )

    def _delta(self, engines: list[EngineReading], name: str) -> float:
        return sum(
            _increase(e.metrics.get(name), self._engines[e.engine_id].get(name))
            for e in engines
            if e.metrics is not None and e.engine_id in self._engines
        )

    def _bucket_delta(self, engines: list[EngineReading], name: str) -> tuple[dict[float, float], dict[float, float]]:
        """A histogram's buckets summed over ``engines`` now and at their last reading (both read)."""
        now: dict[float, float] = {}
        before: dict[float, float] = {}
        for e in engines:
            if e.metrics is None or e.engine_id not in self._engines:
                continue
            last = self._engines[e.engine_id].buckets.get(name, {})
            for le, count in e.metrics.buckets.get(name, {}).items():
                restarted = count < last.get(le, 0.0)
                now[le] = now.get(le, 0.0) + count
                before[le] = before.get(le, 0.0) + (0.0 if restarted else last.get(le, 0.0))
        return now, before

    def _update_means(self, engines: list[EngineReading]) -> None:
        prefill = [e for e in engines if e.role == "prefill"]
        decode = [e for e in engines if e.role == "decode"]
        for pool in (prefill, decode):  # prefill engines first; decode engines when only decode-only ran
            if (finished := self._delta(pool, FINISHED)) > 0:
                self.mean_prompt_tokens = max(self._delta(pool, PROMPT_TOKENS) / finished, 1.0)
                cv2 = histogram_cv2(*self._bucket_delta(pool, PROMPT_LENGTHS))
                self.prompt_tokens_cv2 = self.prompt_tokens_cv2 if cv2 is None else cv2
                break
        if (finished := self._delta(decode, FINISHED)) > 0:
            self.mean_output_tokens = max(self._delta(decode, OUTPUT_TOKENS) / finished, 1.0)

    def _pool(self, engines: list[EngineReading], role: str) -> PoolObservation:
        serving = [e for e in engines if e.state == "ready"]
        answered = [e.metrics for e in serving if e.metrics is not None]
        waiting = round(sum(m.get(WAITING) for m in answered))
        per_request = self.mean_prompt_tokens + (self.mean_output_tokens if role == "decode" else 0.0)
        return PoolObservation(
            replicas=len(serving),
            starting=sum(e.state in STARTING_STATES for e in engines),
            queue_depth=waiting,
            queued_tokens=round(waiting * per_request),
            running=round(sum(m.get(RUNNING) for m in answered)),
            kv_cache_usage=sum(m.get(KV_USAGE) for m in answered) / len(answered) if answered else 0.0,
        )


def decision_record(decision: ScalingDecision, obs: ClusterObservation, current: dict[str, int]) -> dict[str, Any]:
    """What ``pdserve status`` shows of one decision."""
    return {
        "t": time.time(),
        "prefill": decision.prefill,
        "decode": decision.decode,
        "changed": {
            role: [current[role], decision.target(role)] for role in ROLES if current[role] != decision.target(role)
        },
        "observed": {
            "arrival_rps": round(obs.arrival_rate_rps, 3),
            "mean_prompt_tokens": round(obs.mean_prompt_tokens, 1),
            "mean_output_tokens": round(obs.mean_output_tokens, 1),
            "ttft_p90_s": None if obs.ttft_p90_s is None else round(obs.ttft_p90_s, 4),
            "itl_p90_s": None if obs.itl_p90_s is None else round(obs.itl_p90_s, 4),
            "prefill_waiting": obs.prefill.queue_depth,
            "decode_waiting": obs.decode.queue_depth,
        },
        "reasons": decision.reasons,
    }


class Autoscaler:
    """The loop: the controller hands it how to list engines and how to scale; it does the rest.

    ``engines()`` returns ``(engine_id, role, state, url)`` of every engine the
    controller has; ``scale(targets, reason)`` is ``PoolChanges.scale`` (moves allowed, engines kept warm).
    """

    def __init__(
        self,
        config: AutoscalingConfig,
        profile: PerformanceProfile,
        proxy_url: str,
        engines: Callable[[], list[tuple[str, str, str, str]]],
        scale: Callable[[dict[str, int], str], Awaitable[dict[str, Any]]],
        moves: bool = False,
        model: str | None = None,
        season_path: Path | None = None,
    ) -> None:
        """``model``: the served name whose samples of the proxy's page it reads (a cluster of several models);
        ``season_path``: where the learned season (``learn_season``) is kept across controller restarts."""
        self.config = config
        self.model = model
        self.season_path = season_path if config.learn_season else None
        season = load_season(self.season_path) if self.season_path is not None else None
        # moves: the spec allows role moves; the forecaster: the spec's schedule, the season kept from before
        self.policy = AutoscalePolicy(config, profile, moves=moves, forecaster=forecaster_of(config, season))
        self.observer = Observer()
        self.proxy_url = proxy_url
        self.engines = engines
        self.scale = scale
        self.decisions: deque[dict[str, Any]] = deque(maxlen=DECISIONS_KEPT)
        # the decisions that changed a pool, kept apart: at one every few seconds, the last
        # DECISIONS_KEPT decisions soon hold none of them
        self.changes: deque[dict[str, Any]] = deque(maxlen=DECISIONS_KEPT)
        self._started = time.monotonic()
        self._season_seen = 0  # quarter hours the season held when last written

    def _keep_season(self) -> None:
        """Write the season once a quarter hour entered it (a private file: the cluster's load)."""
        forecaster = self.policy.forecaster
        season = forecaster.season if forecaster is not None else None
        if self.season_path is None or season is None:
            return
        seen = sum(n for _, n in season.daily.values())
        if seen != self._season_seen:
            self._season_seen = seen
            try:
                make_private_dirs(self.season_path.parent)
                write_private(self.season_path, json.dumps(season.to_json()))
            except (OSError, UnsafeDirectory) as e:
                logger.warning("the learned season could not be kept in %s: %s", self.season_path, e)

    def status(self) -> dict[str, Any]:
        return {
            "interval_s": self.config.interval_s,
            "targets": {"ttft_p90_s": self.config.targets.ttft_p90_s, "itl_p90_s": self.config.targets.itl_p90_s},
            "decisions": list(self.decisions),
            "changes": list(self.changes),
        }

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as session:
            await self._read(session)  # the baseline
            tick = time.monotonic()
            while True:
                tick = next_tick(tick, time.monotonic(), self.config.interval_s)
                await asyncio.sleep(max(0.0, tick - time.monotonic()))
                try:
                    await self.step(session)
                except Exception:  # a bad step must not end autoscaling for good
                    logger.exception("autoscaler step failed; trying again in %gs", self.config.interval_s)

    async def _read(self, session: aiohttp.ClientSession) -> ClusterObservation:
        engines = self.engines()
        pages = await asyncio.gather(
            _scrape(session, self.proxy_url, {"model": self.model} if self.model else None),
            *(
                _scrape(session, url) if url and state in ("ready", "draining") else _none()
                for _, _, state, url in engines
            ),
        )
        readings = [
            EngineReading(engine_id, role, state, page)
            for (engine_id, role, state, _), page in zip(engines, pages[1:], strict=True)
        ]
        return self.observer.observe(time.monotonic() - self._started, pages[0], readings, clock_s=time.time())

    async def step(self, session: aiohttp.ClientSession) -> ScalingDecision:
        obs = await self._read(session)
        decision = self.policy.decide(obs)
        self._keep_season()
        current = {role: obs.pool(role).provisioned for role in ROLES}
        record = decision_record(decision, obs, current)
        self.decisions.append(record)
        if record["changed"]:
            self.changes.append(record)
            summary = ", ".join(f"{role} {a} -> {b}" for role, (a, b) in record["changed"].items())
            result = await self.scale(
                {role: decision.target(role) for role in ROLES}, f"{AUTOSCALER_REASON}: {summary}; {_why(decision)}"
            )
            if "error" in result:
                record["error"] = result["error"]
                logger.warning("autoscaler could not scale: %s", result["error"])
        return decision


def next_tick(last: float, now: float, interval_s: float) -> float:
    """When the next decision is due: one interval after the last was due, at a fixed rate (not an interval
    after the last step ended: a step takes its scrapes' time, 0.1-0.3 s on a loaded machine, which would
    stretch every interval and move the decisions against the load); at once after a step that overran."""
    return max(last + interval_s, now)


def _why(decision: ScalingDecision) -> str:
    """The decision's demand lines, shortened: what the event log says of an automatic change."""
    lines = [r for r in decision.reasons if r.startswith(("prefill:", "decode:", "feedback:", "trend:"))]
    return "; ".join(lines[:3])


async def _none() -> None:
    return None


async def _scrape(
    session: aiohttp.ClientSession, url: str, labels: dict[str, str] | None = None
) -> MetricsReading | None:
    with contextlib.suppress(ValueError):  # a page that is not Prometheus text counts as no answer
        return await fetch_metrics(session, url, labels)
    return None


def load_season(path: Path) -> Season | None:
    """The season kept at ``path`` (``Autoscaler._keep_season``), or None where there is none or it is unreadable."""
    try:
        return Season.from_json(json.loads(read_private(path, "the autoscaler's learned season", 1 << 20)))
    except FileNotFoundError:
        return None
    except (OSError, UnsafeDirectory, ValueError, TypeError, KeyError, IndexError) as e:
        logger.warning("the learned season in %s is not used: %s", path, e)
        return None
