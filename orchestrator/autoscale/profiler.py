"""Measure the engines of a running cluster and turn the numbers into a performance profile.

``pdserve profile`` drives this module: ``measure(spec, endpoints, grid)`` talks HTTP
to the engines whose URLs ``pdserve status`` gives, reads their own Prometheus
metrics, and returns a ``PerformanceProfile`` (``orchestrator.autoscale.profile``)
that the CLI saves. Every prompt is a fresh random token-id prompt (ids drawn from
what the model's tokenizer gave for a sample text, via the engine's ``/tokenize``),
so the prefix cache never helps; prefill checks it on ``vllm:prefix_cache_hits``.

1. Prefill pass time by tokens and batch. ``batch`` prompts of ``tokens // batch``
   tokens go to a prefill engine as one completions request (``prompt: [[ids], ...]``,
   ``max_tokens: 1``). They share a pass only if they all wait when the engine next
   schedules: vLLM's front end hands a request's prompts to the engine one by one,
   and an idle engine starts a pass on the first alone (on the CPU demo two prompts of
   512 tokens take two passes, 4.8 s, while the engine's prefill time reads 2.4 s per
   prompt: a profile measured so would rate a pass of two sequences twice as fast as
   one of the same tokens, and so would the simulator). So for ``batch`` > 1
   a blocker (one prompt, of ``BLOCKER_MIN_TOKENS`` or more) is sent first and the batch while its pass
   runs: the batch waits for it and is scheduled whole at the next step. The time kept
   is the engine's own ``vllm:request_prefill_time_seconds`` (scheduled -> first
   token), averaged over the batch's prompts (the blocker's is read off before): for
   prompts that shared the pass, that is the pass. An attempt counts only if the
   engine took one step for it (``vllm:iteration_tokens_total``, counted after the
   blocker's); otherwise it is made again. (The client's wall time cannot tell: the
   front end's own ~6 ms a prompt makes a 74-ms pass of 8 prompts of 8 tokens answer in
   121 ms.)
   The median of ``repeats`` good attempts is kept.
2. Decode step time by batch and context. One streaming request of ``batch`` prompts
   of ``context`` tokens and ``decode_tokens`` output tokens (``ignore_eos``) goes
   straight to a decode engine, which computes the prompts itself (no KV transfer),
   sent (for a batch of several) behind a blocker's pass, as for prefill. The prompts
   of one request reach the engine core back to back; sent as separate requests, each
   would cross the API server on its own (HTTP, auth, tokenizer), which leaves more
   room to straddle the blocker's pass.
   When the engine computed the whole batch's prompts in one pass, every sequence
   decodes in the same steps, and the step is read on the engine's own clock: its
   ``vllm:request_decode_time_seconds`` (first to last token, stamped by the engine
   core) over the tokens after the first. ``vllm:iteration_tokens_total`` counts the
   engine's steps, which tells one pass (``decode_tokens`` steps, plus the blocker's)
   from several. A batch whose prompts took several passes (more tokens than one pass
   takes, or a batch that missed the blocker) is read on the client's clock instead:
   each stream's span while ALL sequences decode (after the last first token, before
   the first last token) over the tokens it got in it, pooled over streams and runs.
   vLLM's inter-token histogram would also count the gaps of sequences that decode
   while others still prefill in the same step (chunked prefill), which are prefill
   passes. With ``continuous_usage_stats`` each chunk says how many tokens it carries.
   The client's clock is the fallback because it is the one a stall distorts: when the
   client or the engine's front end is descheduled, tokens that came a step apart are
   read together. On a loaded machine whose engine decodes at 115 ms a token the
   median gap can read ~0.1 ms, and a span of 8 tokens read together gives a step of
   ~0 (and a simulator fed that profile an ITL of 0). A run
   that neither clock can read (several passes, and no stream read while all
   decoded: the API server shares its engine's core, so a batch can miss the
   blocker's pass and reach the client late) is made again, up to
   ``ATTEMPTS_PER_REPEAT`` runs a repeat (five: on a loaded 2-core machine a few
   runs in a row can miss both clocks); the error names what each run showed.
3. Transfer time by bytes. Disaggregated requests of each of ``transfer_tokens``
   prompt lengths go through the proxy one at a time; the decode engine's transfer
   histogram and bytes counter for the cluster's connector (``TRANSFER_METRICS``)
   give each request's KV move: seconds and bytes. ``kv_bytes_per_token`` is all the
   bytes over all the prompt tokens (the long prompts dominate, so the rounding up to
   whole KV blocks weighs little). The same requests are streamed, and what their
   TTFT spent beyond the prefill engine's queue + pass, the transfer and one decode
   step is the hand-off's fixed cost (``handoff_s``, median): HTTP, the proxy, and
   the decode engine's steps of waiting for the KV load to start and finish.
4. Engine limits. The engines do not export ``max_num_seqs`` / ``max_num_batched_tokens``,
   so they come from the spec's ``engine.extra_args`` or else vLLM's defaults for an
   API server on CPU (what ``orchestrator.launch`` leaves them at); on GPU vLLM's
   defaults depend on the device, so the spec must name them. ``kv_capacity_tokens``
   is the decode engine's ``vllm:cache_config_info``; ``startup_s`` is the mean of the
   engines' ``load_s`` (actor start -> serving) in the status.
"""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime

import aiohttp

from orchestrator.autoscale.profile import EngineLimits, Grid1D, Grid2D, PerformanceProfile
from orchestrator.autoscale.profiler_grid import DEFAULT_GRID, ProfileGrid
from orchestrator.autoscale.profiler_http import ClusterEndpoints, Http, RandomPrompts, samples_delta
from orchestrator.autoscale.profiler_readings import (
    CACHE_INFO,
    DECODE_SAMPLES,
    DECODE_TIME,
    GENERATED,
    PREFILL_SAMPLES,
    PREFILL_TIME,
    PREFIX_HITS,
    QUEUE_TIME,
    STEPS,
    DecodeRun,
    TransferSample,
    batch_limits,
    decoding_span,
    handoff_seconds,
    kv_capacity_tokens,
    read_together,
    transfer_table,
)
from orchestrator.engine_metrics import TRANSFER_METRICS, info_labels
from orchestrator.errors import ProfilingError
from orchestrator.spec import ClusterSpec

__all__ = ["decode_run", "format_profile", "measure"]

logger = logging.getLogger(__name__)

BLOCKER_LEAD_S = 0.05
"""How long after the blocker's request the batch's is sent: long enough for the blocker's pass to start."""
BLOCKER_MIN_TOKENS = 512
"""A prefill blocker's prompt is at least this long (within the grid's largest pass): its pass must outlast the front
end's handing the batch's prompts to the engine one by one. The size of one of the batch's prompts does not: on the
CPU demo, 8 prompts of 8 tokens behind an 8-token pass (~10 ms) take two passes in 10 attempts of 10."""
ATTEMPTS_PER_REPEAT = 5
REQUEST_TIMEOUT_S = 900.0


async def _prefill_point(
    http: Http, url: str, model: str, prompts: RandomPrompts, tokens: int, batch: int, grid: ProfileGrid
) -> float:
    """Median prefill time of one pass of ``batch`` sequences of ``tokens // batch`` tokens.

    One pass of several sequences needs them all waiting when the engine next
    schedules. The prompts of one completion request do not: vLLM's front end
    hands them to the engine one by one, an idle engine starts a pass on the
    first, and the others wait for the next (on the CPU demo two prompts of
    512 take two passes, 4.8 s, while the engine's prefill time reads 2.4 s
    per request). So a batch is sent while a pass of one sequence the size
    of the batch's is running (the blocker): the batch waits for it, and is
    scheduled whole at the next step. A measurement counts only if the engine took
    one step for it.
    """
    passes: list[float] = []
    repeats = grid.repeats
    count = PREFILL_TIME + "_count"
    for _ in range(ATTEMPTS_PER_REPEAT * repeats):
        before = await http.samples(url, PREFILL_SAMPLES)
        body = {"model": model, "prompt": [prompts(tokens // batch) for _ in range(batch)], "max_tokens": 1}
        if batch > 1:  # the blocker first; the batch while it runs
            blocker_tokens = max(tokens // batch, min(BLOCKER_MIN_TOKENS, max(grid.prefill_tokens)))
            blocker_body = {"model": model, "prompt": [prompts(blocker_tokens)], "max_tokens": 1, "temperature": 0}
            blocker = asyncio.create_task(http.post(url, "/v1/completions", blocker_body))
            await asyncio.sleep(BLOCKER_LEAD_S)
        sent = time.perf_counter()
        measured = asyncio.create_task(http.post(url, "/v1/completions", body | {"temperature": 0}))
        if batch > 1:  # the sums without the blocker's times: from when it was recorded
            await blocker
            sent = time.perf_counter()  # the batch's pass starts when the blocker's ends
            start, before = before, await http.wait_for(url, PREFILL_SAMPLES, count, before[count] + 1)
        await measured
        wall_s = time.perf_counter() - sent
        if batch > 1 and before[count] != start[count] + 1:  # recorded with the batch's: cannot tell them apart
            logger.info("prefill at %s: the blocker's and the batch's times were recorded together", url)
            continue
        delta = samples_delta(await http.wait_for(url, PREFILL_SAMPLES, count, before[count] + batch), before)
        if delta[PREFIX_HITS] > 0:
            raise ProfilingError(f"{url}: {delta[PREFIX_HITS]:g} prompt tokens hit the prefix cache")
        prefill_s = delta[PREFILL_TIME + "_sum"] / batch
        if delta[STEPS] != 1:
            logger.info(
                "prefill at %s: %d x %d tokens took %g engine steps (%.3fs wall, %.3fs each): not one pass",
                url, batch, tokens // batch, delta[STEPS], wall_s, prefill_s,
            )  # fmt: skip
            continue
        passes.append(prefill_s)
        if len(passes) == repeats:
            return statistics.median(passes)
    raise ProfilingError(
        f"{url}: {batch} sequences of {tokens // batch} tokens never shared one prefill pass in "
        f"{ATTEMPTS_PER_REPEAT * repeats} attempts (the engine took more than one step for them): is something "
        "else using the engine?"
    )


async def decode_run(
    http: Http, url: str, model: str, prompts: RandomPrompts, batch: int, context: int, decode_tokens: int
) -> DecodeRun:
    """``batch`` streams of ``context`` prompt tokens and ``decode_tokens`` output tokens, behind a blocker's pass
    when there are several (module docstring, 2.)."""
    count = DECODE_TIME + "_count"
    body = {"model": model, "max_tokens": decode_tokens, "ignore_eos": True, "temperature": 0}
    before = await http.samples(url, DECODE_SAMPLES)
    blocker = None
    if batch > 1:  # the blocker first; the batch while its pass runs
        blocker = asyncio.create_task(http.stream(url, body | {"prompt": prompts(context), "max_tokens": 1}))
        await asyncio.sleep(BLOCKER_LEAD_S)
    streams = await http.streams(url, body | {"prompt": [prompts(context) for _ in range(batch)]})
    requests = batch
    if blocker is not None:
        await blocker
        requests += 1
    delta = samples_delta(await http.wait_for(url, DECODE_SAMPLES, count, before[count] + requests), before)
    one_pass = delta[STEPS] in (decode_tokens, decode_tokens + requests - batch)
    engine_tokens = delta[GENERATED + "_sum"] - requests  # the blocker's one token adds no decode time
    engine_clock = (delta[DECODE_TIME + "_sum"], engine_tokens)
    return DecodeRun(delta[STEPS], one_pass, engine_clock, decoding_span(streams), read_together(streams))


async def _decode_point(
    http: Http, url: str, model: str, prompts: RandomPrompts, batch: int, context: int, grid: ProfileGrid
) -> float:
    """Decode step of ``batch`` sequences of ``context`` prompt tokens: seconds per token over ``repeats`` runs,
    on the engine's clock when the batch prefilled in one pass, else on the client's (module docstring).

    A run neither clock can read (the batch took several passes, and the client read its tokens together: on
    a loaded machine the API server shares the engine's core) is made again, up to ``ATTEMPTS_PER_REPEAT``
    runs a repeat."""
    seconds, tokens = 0.0, 0.0
    unread: list[str] = []  # what each run neither clock could read showed: the error names it
    for _ in range(grid.repeats):
        for _ in range(ATTEMPTS_PER_REPEAT):
            run = await decode_run(http, url, model, prompts, batch, context, grid.decode_tokens)
            if run.engine is None:
                logger.info(
                    "decode at %s: %d x %d tokens took %g steps for %d tokens each: on the client's clock",
                    url, batch, context, run.steps, grid.decode_tokens,
                )  # fmt: skip
            if (reading := run.reading) is not None and reading[0] > 0:
                seconds, tokens = seconds + reading[0], tokens + reading[1]
                break
            unread.append(f"{run.steps:g} steps, {run.client[1]} tokens in {run.client[0]:.3f}s")
            logger.info("decode at %s: %d x %d tokens read on neither clock: measured again", url, batch, context)
    if tokens <= 0 or seconds <= 0:
        one_pass = grid.decode_tokens + (batch > 1)
        raise ProfilingError(
            f"{url}: the decode step of {batch} sequences of {context} tokens was read on neither clock in "
            f"{ATTEMPTS_PER_REPEAT * grid.repeats} runs: the engine's needs one pass ({one_pass} steps), the "
            f"client's tokens not read together while all decode (runs: {'; '.join(unread)}). "
            "Is something else using the engine or this machine's cores? More --decode-tokens widen the window"
        )
    return seconds / tokens


async def _transfer_samples(
    http: Http, endpoints: ClusterEndpoints, prompts: RandomPrompts, grid: ProfileGrid
) -> list[TransferSample]:
    if endpoints.connector not in TRANSFER_METRICS:
        raise ProfilingError(f"connector {endpoints.connector!r}: no known transfer metrics")
    seconds_name, bytes_name = TRANSFER_METRICS[endpoints.connector]
    names = (seconds_name + "_sum", seconds_name + "_count", bytes_name)
    count, prefill_count = seconds_name + "_count", PREFILL_TIME + "_count"
    samples = []
    # through the proxy: with several engines in a pool, any of them may serve a request
    prefill_pool = endpoints.prefill_pool or (endpoints.prefill_url,)
    decode_pool = endpoints.decode_pool or (endpoints.decode_url,)
    for length in grid.transfer_tokens:
        for _ in range(grid.repeats):
            before = await http.pool_samples(decode_pool, names)
            prefill_before = await http.pool_samples(prefill_pool, PREFILL_SAMPLES)
            body = {"model": endpoints.model, "prompt": prompts(length), "max_tokens": 2, "temperature": 0}
            sent = time.perf_counter()
            chunks = await http.stream(endpoints.proxy_url, body)
            if not chunks:
                raise ProfilingError(f"{endpoints.proxy_url}/v1/completions: the stream carried no token")
            delta = await http.wait_for_one(before, names, count)
            prefill = await http.wait_for_one(prefill_before, PREFILL_SAMPLES, prefill_count)
            # One request may be moved in several transfers: its KV move is their total.
            samples.append(
                TransferSample(
                    length,
                    delta[seconds_name + "_sum"],
                    delta[bytes_name],
                    ttft_s=chunks[0][0] - sent,
                    prefill_s=prefill[PREFILL_TIME + "_sum"] + prefill[QUEUE_TIME + "_sum"],
                )
            )
    return samples


def _engines_text(spec: ClusterSpec) -> str:
    """``"prefill engines on 1 core, TP 1; decode engines on 1 core, TP 1"`` (GPUs: no cores)."""
    parts = []
    for role in ("prefill", "decode"):
        pool = spec.pool(role)
        cores = f"on {pool.cpu_cores} core(s) per rank, " if spec.device == "cpu" else ""
        parts.append(f"{role} engines {cores}TP {pool.tensor_parallel_size}")
    return "; ".join(parts)


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{platform.node()}: {os.cpu_count()} cores ({model})"


async def measure(
    spec: ClusterSpec,
    endpoints: ClusterEndpoints,
    grid: ProfileGrid = DEFAULT_GRID,
    name: str | None = None,
    on_progress: Callable[[str], None] = logger.info,
    seed: int | None = None,
) -> PerformanceProfile:
    """Measure the running engines at ``endpoints`` (started from ``spec``) over ``grid``."""
    max_num_seqs, budget = batch_limits(spec)
    grid.check(max_num_seqs, budget, spec.engine.max_model_len, spec.proxy.decode_only_below_tokens)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    headers = {"Authorization": f"Bearer {endpoints.engine_key}"} if endpoints.engine_key else None
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        http = Http(session)
        model, prefill_url, decode_url = endpoints.model, endpoints.prefill_url, endpoints.decode_url
        prompts = await RandomPrompts.from_engine(http, prefill_url, model, seed)
        capacity = kv_capacity_tokens(info_labels(await http.metrics(decode_url), CACHE_INFO), decode_url)
        largest = grid.decode_batch[-1] * (grid.decode_context[-1] + grid.decode_tokens)
        if largest > capacity:
            raise ProfilingError(
                f"--decode-batch x --decode-context: {largest} tokens exceed the decode engine's KV cache "
                f"({capacity} tokens)"
            )
        # First requests pay one-off costs (buffers, the connector's handshake): not measured.
        await http.post(prefill_url, "/v1/completions", {"model": model, "prompt": prompts(16), "max_tokens": 1})
        await http.stream(decode_url, {"model": model, "prompt": prompts(16), "max_tokens": 4, "ignore_eos": True})
        handshake = {"model": model, "prompt": prompts(max(16, spec.proxy.decode_only_below_tokens)), "max_tokens": 2}
        await http.post(endpoints.proxy_url, "/v1/completions", handshake)

        started = time.monotonic()
        prefill = []
        for tokens in grid.prefill_tokens:
            row = [await _prefill_point(http, prefill_url, model, prompts, tokens, b, grid) for b in grid.prefill_batch]
            cells = zip(grid.prefill_batch, row, strict=True)
            on_progress(f"prefill {tokens:>5} tokens: " + ", ".join(f"batch {b} {s:.3f}s" for b, s in cells))
            prefill.append([round(s, 5) for s in row])
        decode = []
        for batch in grid.decode_batch:
            row = [await _decode_point(http, decode_url, model, prompts, batch, c, grid) for c in grid.decode_context]
            cells = zip(grid.decode_context, row, strict=True)
            on_progress(f"decode batch {batch:>3}: " + ", ".join(f"context {c} {1000 * s:.1f}ms" for c, s in cells))
            decode.append([round(s, 5) for s in row])
        samples = await _transfer_samples(http, endpoints, prompts, grid)
        nbytes, seconds, per_token = transfer_table(samples)
        points = zip(nbytes, seconds, strict=True)
        on_progress("transfer: " + ", ".join(f"{b / 2**20:.2f} MiB {1000 * s:.1f}ms" for b, s in points))
        decode_table = Grid2D([float(b) for b in grid.decode_batch], [float(c) for c in grid.decode_context], decode)
        handoff = handoff_seconds(samples, lambda tokens: decode_table(1, tokens))
        on_progress(f"hand-off beyond the transfer: {1000 * handoff:.1f}ms")
        measured_s = time.monotonic() - started

    seconds_name, bytes_name = TRANSFER_METRICS[endpoints.connector]
    limits_from = "engine.extra_args" if "max_num_seqs" in spec.engine.extra_args else f"vLLM's {spec.device} defaults"
    provenance = (
        f"measured by `pdserve profile` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC in {measured_s:.0f}s on "
        f"{_machine()}; cluster {endpoints.name!r}: {_engines_text(spec)}, model {model!r}, connector "
        f"{endpoints.connector}, max_model_len {spec.engine.max_model_len}. prefill: the engine's {PREFILL_TIME} of "
        f"sequences sharing one pass (a batch sent behind a blocker's pass), median of {grid.repeats}; "
        f"decode: the engine's {DECODE_TIME} per token after the first, of a batch whose prompts shared one "
        f"pass ({STEPS} counts the steps; a batch sent behind a blocker's pass), else client-side seconds per "
        f"token while all sequences decode, pooled ({grid.decode_tokens} output tokens, {grid.repeats} run(s)); "
        "transfer: the decode engine's "
        f"{seconds_name} and {bytes_name} per request through the proxy, median of {grid.repeats}; "
        "handoff_s: those requests' streamed TTFT beyond "
        "the prefill engine's queue + prefill time, the transfer and one decode step, median; "
        f"max_num_seqs, max_num_batched_tokens: {limits_from}; kv_capacity_tokens: {CACHE_INFO}; "
        "startup_s: mean engine load_s"
        + (
            "; the starts' phases ended at (s since the engine was asked for, mean): "
            + ", ".join(f"{name} {s:g}" for name, s in endpoints.startup_phases)
            if endpoints.startup_phases
            else ""
        )
        + "."
    )
    return PerformanceProfile(
        name=name or endpoints.name,
        provenance=provenance,
        engine=EngineLimits(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            kv_capacity_tokens=capacity,
            kv_bytes_per_token=per_token,
            startup_s=endpoints.startup_s,
            handoff_s=handoff,
        ),
        prefill=Grid2D([float(t) for t in grid.prefill_tokens], [float(b) for b in grid.prefill_batch], prefill),
        decode=decode_table,
        transfer=Grid1D(nbytes, seconds),
    )


def format_profile(profile: PerformanceProfile) -> list[str]:
    """The profile as a short table, for the CLI."""
    e = profile.engine
    lines = [
        f"engine    max_num_seqs {e.max_num_seqs}, max_num_batched_tokens {e.max_num_batched_tokens}, "
        f"KV {e.kv_capacity_tokens} tokens x {e.kv_bytes_per_token} B, startup {e.startup_s:g}s",
        "prefill   seconds per pass   " + "".join(f"{f'batch {b:g}':>11}" for b in profile.prefill.cols),
    ]
    for tokens, row in zip(profile.prefill.rows, profile.prefill.seconds, strict=True):
        lines.append(f"          {tokens:>6g} tokens      " + "".join(f"{s:>11.3f}" for s in row))
    lines.append("decode    ms per step        " + "".join(f"{f'ctx {c:g}':>11}" for c in profile.decode.cols))
    for batch, row in zip(profile.decode.rows, profile.decode.seconds, strict=True):
        lines.append(f"          batch {batch:>4g}         " + "".join(f"{1000 * s:>11.1f}" for s in row))
    lines.append(
        "transfer  "
        + ", ".join(
            f"{b / 2**20:.2f} MiB in {1000 * s:.1f} ms"
            for b, s in zip(profile.transfer.x, profile.transfer.y, strict=True)
        )
        + f"; hand-off beyond it {1000 * e.handoff_s:.1f} ms"
    )
    return lines
