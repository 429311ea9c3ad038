"""The one definition of what crosses process boundaries: addresses, endpoints, wire keys.

Plain Python (no vLLM, Ray or zmq), so ``connectors``, ``orchestrator`` and
``proxy`` all import it. Every place that builds or reads an engine's URL, a
side-channel endpoint or a ``kv_transfer_params`` key goes through here.

Side channel: the ``pdserve`` connector of an engine at ``host`` with
``kv_port`` listens once per TP rank, rank ``r`` on ``kv_port + r``
(``side_channel_endpoint``). An IPv6 host is written in brackets, as zmq and
URLs want it.
"""

from __future__ import annotations

import ipaddress
import re

ROLES = ("prefill", "decode")

# --- addresses ------------------------------------------------------------------------------
LISTEN_ALL = ("0.0.0.0", "::")
"""Bind addresses that are not an address a peer can reach."""


def url_host(host: str) -> str:
    """``host`` as it appears in a URL or zmq endpoint (IPv6 literals in brackets)."""
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host  # a name


def http_url(host: str, port: int) -> str:
    return f"http://{url_host(host)}:{port}"


def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://{url_host(host)}:{port}"


def side_channel_endpoint(host: str, kv_port: int, rank: int = 0) -> str:
    """Where TP rank ``rank`` of the engine whose side channel is ``host:kv_port`` listens."""
    return tcp_endpoint(host, kv_port + rank)


def side_channel_endpoints(host: str, kv_port: int, tp_size: int) -> tuple[str, ...]:
    """Every TP rank's side channel of one engine, rank order."""
    return tuple(side_channel_endpoint(host, kv_port, rank) for rank in range(tp_size))


TCP_ENDPOINT_PATTERN = r"^tcp://(\[[0-9A-Fa-f:.]+\]|[^/\s:\[\]]+):\d{1,5}$"
"""One TP rank's side channel: ``tcp://host:port`` (an IPv6 host in brackets)."""
_TCP_ENDPOINT = re.compile(TCP_ENDPOINT_PATTERN)


def parse_tcp_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` -> ``(host, port)``; ``ValueError`` naming the endpoint otherwise."""
    if not _TCP_ENDPOINT.match(endpoint):
        raise ValueError(f"{endpoint!r} is not tcp://host:port")
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    return host.strip("[]"), int(port)


# --- kv_transfer_params ---------------------------------------------------------------------
KV_TRANSFER_PARAMS = "kv_transfer_params"
"""The request/response field vLLM carries connector parameters in."""

DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
REMOTE_ENGINE_ID = "remote_engine_id"
REMOTE_REQUEST_ID = "remote_request_id"
REMOTE_HOST = "remote_host"
REMOTE_PORT = "remote_port"
REMOTE_BLOCK_IDS = "remote_block_ids"
REMOTE_NUM_TOKENS = "remote_num_tokens"
TP_SIZE = "tp_size"
BLOCK_SIZE = "block_size"
PDSERVE_KV = "pdserve_kv"
"""Decode side's answer: how a request's prompt KV got there (a report)."""
PDSERVE_RELEASE = "pdserve_release"
"""Prefill side's offer: ``{"endpoints", "message"}`` to free the blocks if no decode engine reads them."""
PDSERVE_REPORT = "pdserve_report"
"""Prefill side's offer: ``{"message"}`` the proxy sends a decode engine's ranks to learn a stream's report."""
PDSERVE_EXPIRES = "pdserve_expires"
"""Prefill side's: when the issued parameters stop being valid (the lease's end, unix seconds)."""
PDSERVE_READER = "pdserve_reader"
"""The proxy's, to the prefill engine: the decode engine that will read; the prefill binds its parameters to it."""
PDSERVE_MAC = "pdserve_mac"
"""Prefill side's: the MAC over the parameters a decode engine acts on (``connectors.auth``)."""

REMOTE_PREFILL_REQUIRED = (REMOTE_ENGINE_ID, REMOTE_REQUEST_ID, REMOTE_HOST, REMOTE_PORT, REMOTE_BLOCK_IDS)
"""What a decode request's params must carry to load remote KV."""

PREFILL_REQUEST_PARAMS = {
    DO_REMOTE_DECODE: True,
    DO_REMOTE_PREFILL: False,
    REMOTE_ENGINE_ID: None,
    REMOTE_BLOCK_IDS: None,
    REMOTE_HOST: None,
    REMOTE_PORT: None,
}
"""What the proxy sends a prefill engine: compute the prompt, keep its KV for a decode engine."""

# --- an engine's KV tier, asked by the proxy -------------------------------------------------
TIER_HELD_PATH = "/v1/pdserve/tier_held"
"""``POST`` an OpenAI request's body here, with ``?kind=chat`` or ``?kind=completion``: the engine answers how
many of its prompt's tokens its KV tiers hold (``connectors.tier.held``). Under ``/v1``, so vLLM's key check
(the cluster's engine key) guards it like the completions routes."""
TIER_HELD_KINDS = ("chat", "completion")
PROMPT_TOKENS = "prompt_tokens"
"""The answer: the prompt's length in tokens, as the engine renders and tokenizes it."""
TIERS = "tiers"
"""The answer: per tier name (``shared``, ``node``), how many leading prompt tokens it holds (whole chunks)."""
SHARED_TIER = "shared"
"""The tier every engine of the cluster reads (``kv_tier.shared_path``); ``node`` is one node's."""
