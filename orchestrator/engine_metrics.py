"""Reading a vLLM engine's Prometheus ``/metrics`` by sample name, for benchmarks and ``pdserve profile``.

Measurements here are deltas: scrape before, do the work, scrape after. A
histogram is read through its ``_sum`` and ``_count`` samples, a counter
through its ``_total`` sample; samples of one name with different labels (one
per engine index or model) are summed. ``info_labels`` reads the labels of an
info-style gauge such as ``vllm:cache_config_info``, where the values are in
the labels and the sample is always 1.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["TRANSFER_METRICS", "info_labels", "scrape", "sum_samples"]

TRANSFER_METRICS: dict[str, tuple[str, str]] = {
    "pdserve": ("pdserve:kv_transfer_seconds", "pdserve:kv_transfer_bytes_total"),
    "vllm-nixl": ("vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred_sum"),
}
"""Per connector: the KV transfer time histogram (read as ``_sum`` / ``_count``) and the bytes sample,
as the decode engine exports them."""


def sum_samples(text: str, names: tuple[str, ...] | list[str]) -> dict[str, float]:
    """Sum over label sets of each sample name in ``names`` in Prometheus ``text``; 0.0 for a name absent."""
    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


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
