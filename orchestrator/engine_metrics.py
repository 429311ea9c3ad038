"""Reading Prometheus ``/metrics`` pages of engines and the proxy, for the autoscaler, the drain check,
``pdserve status``, benchmarks and ``pdserve profile``.

``parse_metrics`` reads a page once: every sample summed over its label sets,
histogram buckets kept by ``le``; the other readers are views of it.
Measurements here are deltas: scrape before, do the work, scrape after. A
histogram is read through its ``_sum`` and ``_count`` samples, a counter
through its ``_total`` sample; samples of one name with different labels (one
per engine index or model) are summed. ``info_labels`` reads the labels of an
info-style gauge such as ``vllm:cache_config_info``, where the values are in
the labels and the sample is always 1. ``SampleReader`` reads one sample of
many engines at once for ``pdserve status``, each within a short timeout.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "QUARANTINED_BLOCKS",
    "TRANSFER_METRICS",
    "MetricsReading",
    "SampleReader",
    "fetch_metrics",
    "fetch_sample",
    "info_labels",
    "parse_metrics",
    "scrape",
    "sum_samples",
]

TRANSFER_METRICS: dict[str, tuple[str, str]] = {
    "pdserve": ("pdserve:kv_transfer_seconds", "pdserve:kv_transfer_bytes_total"),
    "vllm-nixl": ("vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred_sum"),
}
"""Per connector: the KV transfer time histogram (read as ``_sum`` / ``_count``) and the bytes sample,
as the decode engine exports them."""

QUARANTINED_BLOCKS = "pdserve:kv_quarantined_blocks_total"
"""Decode KV blocks an aborted READ never confirmed drained (``connectors.stats``): out of vLLM's block pool for
the engine's life. A connector that does not quarantine (``vllm-nixl``) has no such sample."""


@dataclass(slots=True)
class MetricsReading:
    """One ``/metrics`` page: every sample summed over its label sets (histogram buckets kept by ``le``)."""

    values: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # histogram -> {le: cumulative count}

    def get(self, name: str) -> float:
        return self.values.get(name, 0.0)


def parse_metrics(text: str, labels: Mapping[str, str] | None = None) -> MetricsReading:
    """``text`` read once; with ``labels``, only the samples whose labels of those names (where they have them)
    have those values: a cluster's proxy labels each model's samples with ``model``."""
    reading = MetricsReading()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if labels and any(sample.labels.get(k, v) != v for k, v in labels.items()):
                continue
            if sample.name.endswith("_bucket") and "le" in sample.labels:
                le = float(sample.labels["le"])
                buckets = reading.buckets.setdefault(sample.name[: -len("_bucket")], {})
                buckets[le] = buckets.get(le, 0.0) + sample.value
            else:
                reading.values[sample.name] = reading.values.get(sample.name, 0.0) + sample.value
    return reading


async def fetch_metrics(
    session: aiohttp.ClientSession, url: str, labels: Mapping[str, str] | None = None
) -> MetricsReading | None:
    """``url``/metrics, parsed; None when the server does not answer it (unreachable, timed out, not 200).
    A page that is not Prometheus text raises ``ValueError``."""
    text = await _fetch_page(session, url)
    return None if text is None else parse_metrics(text, labels)


async def fetch_sample(session: aiohttp.ClientSession, url: str, name: str) -> float | None:
    """Sample ``name`` of ``url``/metrics summed over its label sets; None when the server does not answer it
    (as ``fetch_metrics``), the page is not Prometheus text, or it has no such sample. Only the lines that
    name it are parsed: vLLM's page is tens of kilobytes of histograms."""
    family = name.removesuffix("_total")
    try:
        text = await _fetch_page(session, url)
        if text is None:
            return None
        reading = parse_metrics("".join(line for line in text.splitlines(keepends=True) if family in line))
    except ValueError:  # not text (UnicodeDecodeError), or not Prometheus text
        return None
    return reading.values.get(name)


async def _fetch_page(session: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with session.get(url + "/metrics") as response:
            if response.status != 200:
                return None
            return await response.text()
    except (aiohttp.ClientError, TimeoutError):
        return None


def sum_samples(text: str, names: tuple[str, ...] | list[str]) -> dict[str, float]:
    """Sum over label sets of each sample name in ``names`` in Prometheus ``text``; 0.0 for a name absent."""
    reading = parse_metrics(text)
    return {name: reading.get(name) for name in names}


def info_labels(text: str, name: str) -> dict[str, str] | None:
    """The labels of the first sample called ``name`` (an info gauge), or None if there is none."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return dict(sample.labels)
    return None


def scrape(url: str, names: tuple[str, ...] | list[str], timeout_s: float = 30) -> dict[str, float]:
    """``sum_samples`` of ``url``/metrics, fetched now (blocking; for scripts)."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as response:
        return sum_samples(response.read().decode(), names)


async def engine_gauges(url: str, timeout_s: float = 5.0) -> dict[str, float] | None:
    """The engine's samples on its ``/metrics``, summed over label sets; None if it does not answer."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        reading = await fetch_metrics(session, url)
    return None if reading is None else reading.values


@dataclass(slots=True)
class SampleReader:
    """Sample ``name`` of many engines' ``/metrics``, for ``pdserve status``: the engines are read at once, each
    within ``timeout_s`` (None for one that does not answer by then), so a status never waits longer on a slow
    engine. A reading is kept ``max_age_s``: the CLI's waits ask for the status every 0.5-1 s, and vLLM builds
    its whole page for every scrape."""

    name: str
    timeout_s: float = 2.0
    max_age_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    # (engine id, url) -> (when read, value): an engine at a new address is read at once
    _kept: dict[tuple[str, str], tuple[float, float | None]] = field(default_factory=dict, init=False, repr=False)

    async def read(self, urls: Mapping[str, str]) -> dict[str, float | None]:
        """``name``'s value on each engine of ``urls`` (engine id -> base URL)."""
        now, wanted = self.clock(), set(urls.items())
        kept = {key: tv for key, tv in self._kept.items() if key in wanted and now - tv[0] < self.max_age_s}
        if due := [key for key in urls.items() if key not in kept]:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as session:
                values = await asyncio.gather(*(fetch_sample(session, url, self.name) for _, url in due))
            kept.update({key: (now, value) for key, value in zip(due, values, strict=True)})
        self._kept = kept
        return {engine_id: kept[(engine_id, url)][1] for engine_id, url in urls.items()}
