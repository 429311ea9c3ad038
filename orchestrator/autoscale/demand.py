"""How many engines a load needs: steps 1 to 3 of ``orchestrator.autoscale.policy``.

Pure functions of the settings (``AutoscalingConfig``), the engines' profile (``PerformanceProfile``) and one
window's ``ClusterObservation``; each appends one line of its arithmetic to ``reasons``.

- ``prefill_demand``: the fewest engines for which at most ``TTFT_TAIL`` of the requests wait past what their
  prompt's TTFT budget leaves (M/G/c, ``wait_tail``, over ``LENGTH_QUANTILES`` prompt lengths:
  ``wait_budgets``), plus what clears the queue; at a cold start, the ``Backlog`` decode takes next.
- ``decode_demand``: by Little's law, the engines that hold the window's sequences at the batch one engine
  steps within the ITL target (``_decode_batch``), plus what seats the requests waiting for a slot.
- ``drain``: a cold start's engines split between clearing the prefill backlog and decoding what it releases.
- ``feedback``: a measured p90 above its target sets a floor of one engine more on the pool to blame.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from contract.wire import ROLES

if TYPE_CHECKING:
    from orchestrator.autoscale.config import AutoscalingConfig
    from orchestrator.autoscale.observation import ClusterObservation
    from orchestrator.autoscale.profile import PerformanceProfile

__all__ = [
    "DECODE_BLAME_SHARE",
    "LENGTH_QUANTILES",
    "TTFT_TAIL",
    "Backlog",
    "decode_demand",
    "drain",
    "feedback",
    "prefill_demand",
    "wait_budgets",
    "wait_tail",
]

# At most this share of the requests may wait past what their prompt's TTFT budget leaves. The targets are
# p90s, but the wait is only part of a request's TTFT and the budget an estimate of what is left of it: a tail
# of 1 % is what keeps the targets on the widest range of simulated loads (docs/autoscaling-research.md).
TTFT_TAIL = 0.01
LENGTH_QUANTILES = 20  # prompt lengths the wait budget is taken over (quantiles of a log-normal)
# A TTFT breach is decode's when the requests waiting for a decode slot would wait, by Little's law
# (waiting / arrival rate), more than this share of the TTFT target; else prefill's. Where outputs are long, a
# few requests always wait for a slot: blaming decode for any wait would grow decode while prefill is the wait.
DECODE_BLAME_SHARE = 0.5

# The standard normal's quantiles at the middles of LENGTH_QUANTILES equal slices: the prompt lengths'.
_LENGTH_Z = [statistics.NormalDist().inv_cdf((i + 0.5) / LENGTH_QUANTILES) for i in range(LENGTH_QUANTILES)]


@dataclass(slots=True, frozen=True)
class Backlog:
    """A cold start's prefill backlog (and what queues until new engines serve), cleared within ``horizon_s``."""

    requests: float  # queued and queuing prompts
    horizon_s: float
    prefill_for_rate: int  # the prefill engines wanted before the backlog's


def wait_tail(servers: int, arrival_rate: float, service_s: float, waits: list[float], service_cv2: float) -> float:
    """The share of requests that wait past their own budget in an M/G/c queue (c = ``servers``), each budget
    of ``waits`` equally likely: the mean over ``waits`` of P(wait > w); 1.0 when the queue is unstable.

    P(wait > w) is Erlang C's M/M/c tail, stretched as Allen and Cunneen's M/G/c approximation stretches the
    mean wait: by (1 + ``service_cv2``) / 2, the squared coefficient of variation of service times (1 for
    M/M/c). Heavy-tailed prompts (cv2 of 3-4) wait about twice as long as their mean alone says."""
    if arrival_rate <= 0:
        return 0.0
    offered = arrival_rate * service_s  # in Erlangs
    if offered >= servers:
        return 1.0
    # Erlang B by its stable recurrence, then Erlang C from it.
    erlang_b = 1.0
    for k in range(1, servers + 1):
        erlang_b = offered * erlang_b / (k + offered * erlang_b)
    utilization = offered / servers
    p_wait = erlang_b / (1 - utilization + utilization * erlang_b)
    decay = (servers - offered) / (service_s * (1 + max(service_cv2, 0.0)) / 2)
    return p_wait * sum(math.exp(-decay * max(w, 0.0)) for w in waits) / len(waits)


def wait_budgets(config: AutoscalingConfig, profile: PerformanceProfile, mean: float, cv2: float) -> list[float]:
    """What each of ``LENGTH_QUANTILES`` prompt lengths (quantiles of a log-normal with the window's mean and
    cv^2) can wait and still meet the TTFT target: the target less an idle engine's prefill, KV hand-off and
    first decode step for it. A long prompt affords less wait than the mean one; lengths an idle engine
    alone serves late are left out (no number of engines helps them)."""
    target = config.targets.ttft_p90_s
    sigma = math.sqrt(math.log1p(max(cv2, 0.0)))
    mu = math.log(mean) - sigma * sigma / 2
    budgets = []
    for z in _LENGTH_Z:
        length = math.exp(mu + sigma * z)
        idle = (
            profile.prefill_seconds(length, 1)
            + profile.handoff_seconds(int(length))
            + profile.decode_step_seconds(1, length)
        )
        if idle < target:
            budgets.append(target - idle)
    return budgets


def prefill_demand(
    config: AutoscalingConfig,
    profile: PerformanceProfile,
    obs: ClusterObservation,
    rate: float,
    cold: bool,
    reasons: list[str],
) -> tuple[int, int, Backlog | None]:
    """Engines for ``rate`` (the TTFT tail), and those plus what clears the queue: (with, without it, and a
    cold start's backlog, which decode then takes as it clears: ``drain``). ``cold``: the policy started with
    the pools at the spec's sizes and has watched them for less than a scale-down cooldown."""
    cfg, prof = config, profile
    budget = prof.engine.max_num_batched_tokens
    prompt = max(obs.mean_prompt_tokens, 1.0)
    per_pass = max(1, min(prof.engine.max_num_seqs, round(budget / prompt)))
    tokens_per_s = budget / prof.prefill_seconds(budget, per_pass)
    service_s = prompt / tokens_per_s
    cv2 = obs.prompt_tokens_cv2
    budgets = wait_budgets(cfg, prof, prompt, cv2)
    late = LENGTH_QUANTILES - len(budgets)
    if not budgets:
        reasons.append(
            f"prefill: an idle engine alone needs over the {cfg.targets.ttft_p90_s:g}s TTFT target for "
            f"every prompt length around {prompt:.0f} tokens; sizing for no waiting at all"
        )
        budgets = [0.0]
    # From the load up (fewer engines than the load never keep up), past max_engines if need be: a pool
    # short of its need is shared the budget by what it needs, not by the budget itself (fit_budget).
    load = rate * service_s
    n, limit = max(1, math.floor(load)), 2 * math.ceil(load) + cfg.max_engines
    while n < limit and wait_tail(n, rate, service_s, budgets, cv2) > TTFT_TAIL:
        n += 1
    reasons.append(
        f"prefill: {rate:.2f} req/s x {prompt:.0f} tokens = "
        f"{rate * prompt:.0f} tok/s at {tokens_per_s:.0f} tok/s/engine "
        f"(load {load:.2f} engines); "
        f"P(wait > its budget) <= {TTFT_TAIL:.0%} over {LENGTH_QUANTILES} prompt lengths (M/G/c, prompt cv^2 "
        f"{cv2:.2f}; {late} late even unqueued) needs {n}"
    )
    for_rate, cold_backlog = n, None
    backlog = obs.prefill.queued_tokens
    # Until new engines serve, the engines serving now take the arrivals: what they cannot
    # compute in that time (at the mean of the rate now and the rate expected) queues up too.
    startup = prof.engine.startup_s
    serving_rps = obs.prefill.replicas * tokens_per_s / prompt
    growth = max(0.0, (rate + obs.arrival_rate_rps) / 2 - serving_rps) * prompt * startup
    if backlog > 0 or growth > 0:
        # New engines help only once started: the backlog is cleared over that horizon, not one interval.
        # Engines started to clear a burst's backlog within one interval would outlive it and, held by the
        # burst guard, stay as a reserve the load does not need. At a cold start a backlog is the start
        # falling short of the load instead: it is cleared within one interval of the new engines' serving,
        # and decode is sized for what that releases (``drain``).
        horizon = cfg.interval_s if cold else cfg.interval_s + startup
        extra = math.ceil((backlog + growth) / (tokens_per_s * horizon))
        if cold:
            cold_backlog = Backlog((backlog + growth) / prompt, horizon, n)
        n += extra
        grows = f" and {growth:.0f} more tokens queue up before new engines serve" if growth > 0 else ""
        within = (
            f"within {horizon:g}s of serving (a start under load: first {cfg.scale_down_cooldown_s:g}s)"
            if cold
            else f"in {horizon:g}s"
        )
        reasons.append(
            f"prefill: {obs.prefill.queue_depth} queued requests ({backlog} tokens){grows}: "
            f"{extra} more to clear them {within}"
        )
    return n, for_rate, cold_backlog


def _decode_batch(config: AutoscalingConfig, profile: PerformanceProfile, context: float, kv_per_seq: float) -> int:
    """The largest batch whose step time is within ``target_utilization`` of the ITL target and whose
    sequences fill at most that fraction of the KV cache (batches and contexts vary around the mean)."""
    prof, cfg = profile, config
    by_kv = int(cfg.target_utilization * prof.engine.kv_capacity_tokens // max(kv_per_seq, 1.0))
    batch = max(1, min(prof.engine.max_num_seqs, by_kv))
    while batch > 1 and prof.decode_step_seconds(batch, context) > cfg.target_utilization * cfg.targets.itl_p90_s:
        batch -= 1
    return batch


def _decode_shape(
    config: AutoscalingConfig, profile: PerformanceProfile, obs: ClusterObservation
) -> tuple[float, int, float]:
    """(mean output tokens, the batch one decode engine should hold, its step time) for the window's lengths."""
    prompt, output = max(obs.mean_prompt_tokens, 1.0), max(obs.mean_output_tokens, 1.0)
    batch = _decode_batch(config, profile, prompt + output / 2, prompt + output)
    return output, batch, profile.decode_step_seconds(batch, prompt + output / 2)


def decode_demand(
    config: AutoscalingConfig, profile: PerformanceProfile, obs: ClusterObservation, rate: float, reasons: list[str]
) -> tuple[int, int]:
    """Engines for ``rate`` (the ITL target), and those plus what seats the requests waiting for a slot."""
    cfg = config
    output, batch, step_s = _decode_shape(config, profile, obs)
    concurrency = rate * output * step_s
    n = max(1, math.ceil(concurrency / batch))
    reasons.append(
        f"decode: {rate:.2f} req/s x {output:.0f} tokens x {step_s * 1000:.1f} ms/step = "
        f"{concurrency:.1f} sequences at once; {batch}/engine (step within {cfg.target_utilization:.0%} of "
        f"ITL {cfg.targets.itl_p90_s * 1000:g} ms, KV within {cfg.target_utilization:.0%}) needs {n}"
    )
    waiting, extra, pool = obs.decode.queue_depth, 0, obs.decode
    # vLLM's waiting gauge counts the requests whose KV is still loading, too: they wait for a slot only where
    # the engines have none left (every sequence seat taken, or the KV cache as full as the policy fills it).
    full = pool.running >= pool.replicas * profile.engine.max_num_seqs or (
        pool.kv_cache_usage >= cfg.target_utilization
    )
    if waiting > 0 and full:
        extra = math.ceil(waiting / batch)
        reasons.append(f"decode: {waiting} requests wait for a decode slot; {extra} more")
    elif waiting > 0:
        reasons.append(
            f"decode: {waiting} waiting with room to spare ({pool.running} running, KV "
            f"{pool.kv_cache_usage:.0%}): loading their KV, no more engines"
        )
    return n + extra, n


def drain(
    config: AutoscalingConfig,
    profile: PerformanceProfile,
    obs: ClusterObservation,
    backlog: Backlog,
    prefill: int,
    decode: int,
    reasons: list[str],
) -> tuple[int, int]:
    """A cold start's wishes with decode sized for the backlog prefill clears. Cleared within its horizon, the
    backlog's prompts reach decode at that rate on top of the arrivals, and are decoded as those are; where
    the engines beyond both pools' needs for the rate (``prefill_for_rate``, ``decode``) cannot hold both,
    they are split in the proportion the two need, so that decode holds what prefill hands it. Sized for
    prefill alone, the backlog would reach a decode pool sized for the arrivals alone, which then misses the
    ITL target while the backlog drains through it."""
    output, batch, step_s = _decode_shape(config, profile, obs)
    rate = backlog.requests / backlog.horizon_s
    for_prefill = prefill - backlog.prefill_for_rate
    for_decode = math.ceil(min(backlog.requests, rate * output * step_s) / batch)
    room = max(0, config.max_engines - backlog.prefill_for_rate - decode)
    if for_prefill + for_decode > room:
        for_decode = math.ceil(for_decode * room / (for_prefill + for_decode))
        for_prefill = max(0, room - for_decode)
    reasons.append(
        f"decode: the backlog's {backlog.requests:.0f} prompts reach decode at {rate:.1f} req/s as prefill "
        f"clears them: {for_decode} more; of the {room} engines beyond both pools' needs, prefill "
        f"{for_prefill} and decode {for_decode}"
    )
    return backlog.prefill_for_rate + for_prefill, decode + for_decode


def feedback(config: AutoscalingConfig, obs: ClusterObservation, reasons: list[str]) -> dict[str, int]:
    """Each pool's floor from the measured latencies: one engine more than it has for the pool a p90 above its
    target blames (0: no floor). A wrong profile then cannot hold the cluster in breach."""
    cfg = config
    floor = dict.fromkeys(ROLES, 0)
    if obs.ttft_p90_s is not None and obs.ttft_p90_s > cfg.targets.ttft_p90_s:
        decode_wait_s = obs.decode.queue_depth / max(obs.arrival_rate_rps, 1e-9)
        role = "decode" if decode_wait_s > DECODE_BLAME_SHARE * cfg.targets.ttft_p90_s else "prefill"
        floor[role] = obs.pool(role).provisioned + 1
        reasons.append(
            f"feedback: measured p90 TTFT {obs.ttft_p90_s:.3f}s > {cfg.targets.ttft_p90_s:g}s "
            f"({obs.decode.queue_depth} waiting for a decode slot, ~{min(decode_wait_s, 1e6):.2f}s by Little's "
            f"law: {role} is the wait): {role} at least {floor[role]}"
        )
    if obs.itl_p90_s is not None and obs.itl_p90_s > cfg.targets.itl_p90_s:
        floor["decode"] = max(floor["decode"], obs.decode.provisioned + 1)
        reasons.append(
            f"feedback: measured p90 ITL {obs.itl_p90_s * 1000:.1f} ms > {cfg.targets.itl_p90_s * 1000:g} ms: "
            f"decode at least {floor['decode']}"
        )
    return floor
