"""The response headers pdserve's proxy adds, by name: what a client reads of how its request was served.

- ``PATH``: ``disaggregated``, or ``decode-only`` / ``prefill-only`` with ``; reason=...``.
- ``PREFILL`` and ``DECODE``: the engine ids of the legs (no ``PREFILL`` when decode-only).
- ``KV``: how the prompt's KV reached the decode engine (``contract.kv_report.KVReport.header``).
- ``MIGRATED``: the decode engines that died under the request before another answered it, in order
  (``proxy.flow``: a non-streamed answer's decode migration).

HTTP header names are case-insensitive; these are the spellings pdserve sends.
"""

from __future__ import annotations

__all__ = ["DECODE", "KV", "MIGRATED", "PATH", "PREFILL"]

PATH = "X-PDServe-Path"
PREFILL = "X-PDServe-Prefill"
DECODE = "X-PDServe-Decode"
KV = "X-PDServe-KV"
MIGRATED = "X-PDServe-Migrated"
