"""``pdserve proxy``: the proxy without Ray, in front of vLLM servers someone else started.

A drop-in for vLLM's example P/D proxy: give it the prefill and decode servers'
URLs (each a vLLM server started with a KV connector); it serves the same app
as the orchestrated proxy (``proxy.app``) with the engines fixed for its life.
Engines are named by role and position: ``prefill-0``, ``prefill-1``,
``decode-0``... A decode server of the ``pdserve`` connector may be given its
side channel (``--decode-kv``): its streams then carry ``X-PDServe-KV``.

The model's name is the one given, or else learnt from the engines:
``model_name_from_engines`` asks each one's ``GET /v1/models`` (waiting for
engines still starting) and insists they all serve the same model.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI

from proxy.app import create_app
from proxy.config import ProxyConfig
from proxy.pool import KV_ENDPOINT_PATTERN, Endpoint, EnginePool

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 1.0


class StandaloneError(Exception):
    """The standalone proxy cannot start: the message says why, for the command line."""


@dataclass(frozen=True, slots=True)
class StandaloneSettings:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    config: ProxyConfig
    decode_kv_endpoints: tuple[tuple[str, ...], ...] = ()
    """Per decode server, in ``decode_urls``' order: its ``pdserve`` connector side channel (one per TP rank)."""

    def pool(self) -> EnginePool:
        pool = EnginePool()
        pool.set_endpoints("prefill", [Endpoint(f"prefill-{i}", url) for i, url in enumerate(self.prefill_urls)])
        kv = self.decode_kv_endpoints or ((),) * len(self.decode_urls)
        decode = zip(self.decode_urls, kv, strict=True)
        pool.set_endpoints("decode", [Endpoint(f"decode-{i}", url, ranks) for i, (url, ranks) in enumerate(decode)])
        return pool


_KV_ENDPOINT = re.compile(KV_ENDPOINT_PATTERN)


def parse_kv_endpoints(values: list[str], decode_count: int) -> tuple[tuple[str, ...], ...]:
    """``--decode-kv``: one value per ``--decode`` server, each a comma-separated ``tcp://host:port`` per TP rank."""
    if not values:
        return ()
    if len(values) != decode_count:
        raise StandaloneError(
            f"--decode-kv: {len(values)} value(s) for {decode_count} --decode server(s); give one per server, "
            "in the same order (its ranks comma-separated)"
        )
    parsed = []
    for value in values:
        ranks = tuple(part.strip() for part in value.split(","))
        if bad := [rank for rank in ranks if not _KV_ENDPOINT.match(rank)]:
            raise StandaloneError(f"--decode-kv: {bad[0]!r} is not tcp://host:port (the engine's kv_port + rank)")
        parsed.append(ranks)
    return tuple(parsed)


def build_app(settings: StandaloneSettings) -> FastAPI:
    """The app one worker serves (module level, so that worker processes can be given it)."""
    return create_app(settings.config, settings.pool())


def app_factory(settings: StandaloneSettings) -> Callable[[], FastAPI]:
    return functools.partial(build_app, settings)


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` → ``http://host:port``; the proxy appends ``/v1/...``."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise StandaloneError(f"{url!r}: only http:// and https:// engine URLs are supported")
    return url.removesuffix("/v1")


def model_name_from_engines(
    urls: list[str],
    wait_s: float,
    on_wait: Callable[[list[str]], None] | None = None,
    engine_key: str | None = None,
) -> tuple[str, ...]:
    """The model every engine in ``urls`` serves, then the LoRA adapters they serve it with, from their
    ``/v1/models`` (an adapter is listed with the model as its ``parent``).

    Engines that do not answer yet are asked again every second, for up to
    ``wait_s``; ``on_wait(missing)`` is called once when some have to be
    waited for. Raises ``StandaloneError`` if an engine never answers or the
    engines disagree.
    """
    deadline = time.monotonic() + wait_s
    served: dict[str, tuple[str, ...]] = {}
    problems: dict[str, str] = {}
    told = False
    while True:
        for url in urls:
            if url in served:
                continue
            try:
                served[url] = _served_model(url, engine_key)
                problems.pop(url, None)
            except _NotServing as e:
                problems[url] = str(e)
        missing = [url for url in urls if url not in served]
        if not missing or time.monotonic() >= deadline:
            break
        if not told and on_wait is not None:
            on_wait(missing)
            told = True
        time.sleep(min(POLL_INTERVAL_S, max(deadline - time.monotonic(), 0.0)))
    if missing:
        why = "; ".join(f"{url}: {problems[url]}" for url in missing)
        raise StandaloneError(f"no model name from {len(missing)} engine(s) within {wait_s:g} s ({why}); use --model")
    names = set(served.values())
    if len(names) > 1:
        listing = ", ".join(f"{url} serves {', '.join(map(repr, models))}" for url, models in served.items())
        raise StandaloneError(f"the engines serve different models: {listing}")
    return names.pop()


class _NotServing(Exception):
    pass


def _served_model(url: str, engine_key: str | None = None) -> tuple[str, ...]:
    """The first model of ``url``'s ``/v1/models`` (vLLM lists its served model name first), then its adapters."""
    request = urllib.request.Request(url + "/v1/models")
    if engine_key is not None:
        request.add_header("Authorization", f"Bearer {engine_key}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            listing = json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise _NotServing(f"/v1/models answered HTTP {e.code}") from e
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise _NotServing(f"not reachable ({reason})") from e
    except ValueError as e:
        raise _NotServing(f"/v1/models is not JSON ({e})") from e
    try:
        base = str(listing["data"][0]["id"])
        adapters = [str(m["id"]) for m in listing["data"][1:] if m.get("parent") == base]
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        raise _NotServing("/v1/models lists no model") from e
    return (base, *adapters)
