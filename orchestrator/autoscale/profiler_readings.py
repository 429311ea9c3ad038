"""What the profiler reads off the engines, and the pure computations that turn it into a profile's numbers.

The vLLM metrics it scrapes (names and the samples it sums), the engines' batch limits (from the spec, or
vLLM's CPU defaults) and KV capacity, the decode step as both clocks read a run (``DecodeRun``,
``decoding_span``), and the KV transfer table and hand-off cost from single-request samples
(``TransferSample``, ``transfer_table``, ``handoff_seconds``). No I/O: ``orchestrator.autoscale.profiler``
takes the measurements.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.errors import ProfilingError
from orchestrator.spec import ClusterSpec

__all__ = [
    "DecodeRun",
    "TransferSample",
    "batch_limits",
    "decoding_span",
    "read_together",
    "handoff_seconds",
    "kv_capacity_tokens",
    "transfer_table",
]

CPU_DEFAULT_MAX_NUM_SEQS = 128
CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
"""vLLM's defaults for an OpenAI API server on CPU, per TP rank (``EngineArgs.get_batch_defaults``)."""

PREFILL_TIME = "vllm:request_prefill_time_seconds"
QUEUE_TIME = "vllm:request_queue_time_seconds"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
CACHE_INFO = "vllm:cache_config_info"
DECODE_TIME = "vllm:request_decode_time_seconds"
GENERATED = "vllm:request_generation_tokens"
STEPS = "vllm:iteration_tokens_total_count"
"""Engine steps that produced tokens (one observation per step's outputs)."""
PREFILL_SAMPLES = (PREFILL_TIME + "_sum", PREFILL_TIME + "_count", QUEUE_TIME + "_sum", PREFIX_HITS, STEPS)
DECODE_SAMPLES = (DECODE_TIME + "_sum", DECODE_TIME + "_count", GENERATED + "_sum", STEPS)
TOGETHER_GAP_S = 1e-3
"""Chunks of a stream that reach the client under this far apart (the median gap, while all decode) are read
together: the client or the front end was descheduled, and the span holds its wait, not the engine's steps."""


def batch_limits(spec: ClusterSpec) -> tuple[int, int]:
    """(max_num_seqs of a decode engine, max_num_batched_tokens of a prefill engine) as they run."""

    def setting(name: str, role: str, cpu_default: int) -> int:
        extra = spec.engine.extra_args
        value = extra.get(name, extra.get(name.replace("_", "-")))
        if value is not None:
            return int(value)
        if spec.device != "cpu":
            raise ProfilingError(
                f"engine.extra_args.{name}: must be set for device {spec.device!r}: vLLM's default there depends "
                "on the GPU, and the engines do not export it"
            )
        return cpu_default * spec.pool(role).tensor_parallel_size

    return (
        setting("max_num_seqs", "decode", CPU_DEFAULT_MAX_NUM_SEQS),
        setting("max_num_batched_tokens", "prefill", CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS),
    )


def kv_capacity_tokens(labels: dict[str, str] | None, url: str) -> int:
    """Tokens of KV cache one engine holds, from the labels of its ``vllm:cache_config_info``."""
    if labels is None:
        raise ProfilingError(f"{url}/metrics: no {CACHE_INFO}: cannot read the engine's KV capacity")
    size = labels.get("kv_cache_size_tokens", "None")
    if size != "None":
        return int(float(size))
    blocks, block_size = labels.get("num_gpu_blocks", "None"), labels.get("block_size", "None")
    if blocks == "None" or block_size == "None":
        raise ProfilingError(f"{url}/metrics: {CACHE_INFO} has neither kv_cache_size_tokens nor num_gpu_blocks")
    return int(blocks) * int(block_size)


def _while_all_decode(streams: list[list[tuple[float, int]]]) -> list[list[tuple[float, int]]]:
    """Each stream's chunks while all streams were decoding: the window opens at the last stream's first token
    (every prompt computed) and closes at the first stream's last token (one has finished); none when a stream
    has no chunk."""
    if any(not s for s in streams):
        return []
    start, end = max(s[0][0] for s in streams), min(s[-1][0] for s in streams)
    return [[(t, n) for t, n in stream if start <= t <= end] for stream in streams]


def decoding_span(streams: list[list[tuple[float, int]]]) -> tuple[float, int]:
    """Seconds and tokens of every stream while all streams were decoding, summed over streams.

    A stream is its chunks as ``(arrival time, tokens generated so far)``, the first one
    carrying the first token. A stream counts from its first chunk in the window
    (``_while_all_decode``) to its last.
    """
    seconds, tokens = 0.0, 0
    for inside in _while_all_decode(streams):
        if len(inside) >= 2:
            seconds += inside[-1][0] - inside[0][0]
            tokens += inside[-1][1] - inside[0][1]
    return seconds, tokens


def read_together(streams: list[list[tuple[float, int]]]) -> bool:
    """Whether the client read the streams' tokens together while all decoded (``decoding_span``'s window): the
    median gap between a stream's chunks there under ``TOGETHER_GAP_S``, or no gap to tell by."""
    gaps = [b - a for inside in _while_all_decode(streams) for (a, _), (b, _) in itertools.pairwise(inside)]
    return not gaps or statistics.median(gaps) < TOGETHER_GAP_S


@dataclass(slots=True, frozen=True)
class TransferSample:
    prompt_tokens: int
    seconds: float
    nbytes: float
    ttft_s: float = 0.0  # the client's, through the proxy
    prefill_s: float = 0.0  # the prefill engine's queue + prefill time for it


def handoff_seconds(samples: list[TransferSample], decode_step: Callable[[int], float]) -> float:
    """The hand-off's fixed cost: the median over requests of what their TTFT through the proxy spent beyond
    the prefill engine's queue + pass, the KV transfer and one decode step (``decode_step(prompt_tokens)``).

    It is HTTP to and from both engines, the proxy's work, and the decode engine's scheduling of a
    request whose KV arrives from elsewhere (it waits a step for the load to start and one for it to
    finish). On the CPU demo it is about 0.15-0.25 s, which a simulator without it misses at light load.
    """
    extra = [s.ttft_s - s.prefill_s - s.seconds - decode_step(s.prompt_tokens) for s in samples]
    return round(max(0.0, statistics.median(extra)), 4) if extra else 0.0


def transfer_table(samples: list[TransferSample]) -> tuple[list[float], list[float], int]:
    """(bytes axis, seconds, kv_bytes_per_token) from single-request transfer samples.

    Samples of one prompt length give one point (their medians); lengths whose KV fills
    the same number of blocks move the same bytes and merge into one point, so the
    bytes axis increases strictly as the profile format requires.
    """
    if not samples or any(s.nbytes <= 0 for s in samples):
        raise ProfilingError("no KV transfer moved any bytes: the connector's bytes counter did not grow")
    by_bytes: dict[float, list[TransferSample]] = {}
    for length in sorted({s.prompt_tokens for s in samples}):
        of_length = [s for s in samples if s.prompt_tokens == length]
        nbytes = statistics.median(s.nbytes for s in of_length)
        by_bytes.setdefault(nbytes, []).extend(of_length)
    axis = sorted(by_bytes)
    seconds = [round(statistics.median(s.seconds for s in by_bytes[b]), 6) for b in axis]
    per_token = sum(s.nbytes for s in samples) / sum(s.prompt_tokens for s in samples)
    return axis, seconds, round(per_token)


@dataclass(slots=True, frozen=True)
class DecodeRun:
    """One run of a decode point: the engine's steps, whether they were one pass of the batch, and both clocks'
    (seconds, tokens): the engine's decode time over its tokens after the first (steps of fewer sequences, or
    with a prompt's pass, included when not one pass), and the client's while all decoded."""

    steps: float
    one_pass: bool
    engine_clock: tuple[float, float]
    client: tuple[float, int]
    together: bool  # the client read the tokens together (``read_together``): its clock does not read the steps

    @property
    def engine(self) -> tuple[float, float] | None:
        """The engine's clock when the batch's prompts shared one pass (every sequence decoded in its steps)."""
        return self.engine_clock if self.one_pass and self.engine_clock[1] > 0 else None

    @property
    def reading(self) -> tuple[float, float] | None:
        """The engine's clock when the batch shared one pass; else the client's, unless its tokens were read
        together (``read_together``). Not against the engine's own time per token: with the batch's prompts in
        several passes, that holds the later passes (a 2048-token pass on the CPU demo), and the client's true
        reading is under half of it (8 x 512 tokens: 55 ms a token, read on neither clock)."""
        if (engine := self.engine) is not None:
            return engine
        seconds, tokens = self.client
        if tokens > 0 and seconds > 0 and not self.together:
            return self.client
        return None
