"""The one definition of what crosses process boundaries: addresses, endpoints, wire keys.

Plain Python and pydantic (no vLLM, Ray or zmq), so ``connectors``, ``orchestrator``
and ``proxy`` all import it. Every place that builds or reads an engine's URL, a
side-channel endpoint or a ``kv_transfer_params`` key goes through here, and
``KVTransferParams`` is the one model of the parameters a decode engine acts on:
every field type- and range-checked before anything reads it (``parse_remote_prefill``).

Side channel: the ``pdserve`` connector of an engine at ``host`` with
``kv_port`` listens once per TP rank, rank ``r`` on ``kv_port + r``
(``side_channel_endpoint``). An IPv6 host is written in brackets, as zmq and
URLs want it.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Annotated, Any, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

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


# --- the OpenAI API the proxy serves and the engines answer ----------------------------------
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESPONSES_PATH = "/v1/responses"
MODELS_PATH = "/v1/models"
TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"


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
PDSERVE_EPOCH = "pdserve_epoch"
"""Prefill side's: which start of the engine issued the parameters (``connectors.identity.engine_epoch``)."""
PDSERVE_MAC = "pdserve_mac"
"""Prefill side's: the MAC over the parameters a decode engine acts on (``contract.auth``)."""

REMOTE_PREFILL_REQUIRED = (REMOTE_ENGINE_ID, REMOTE_REQUEST_ID, REMOTE_HOST, REMOTE_PORT, REMOTE_BLOCK_IDS)
"""What a decode request's params must carry to load remote KV."""

CLIENT_FORBIDDEN_FIELDS = (KV_TRANSFER_PARAMS, "ec_transfer_params")
"""Request fields vLLM (0.32) hands its connectors: set by pdserve between its engines, never by a client.
``vllm_xargs`` entries of these names land in the same place (vLLM copies ``vllm_xargs`` into the request's
``extra_args``, where ``Request.kv_transfer_params`` is read from), so they are refused there too."""
VLLM_XARGS = "vllm_xargs"

MAX_BLOCK_IDS = 1 << 20
"""The most remote blocks one request's parameters may name (a 1M-token prompt in blocks of one)."""
MAX_BLOCK_ID = (1 << 31) - 1
MAX_TP_SIZE = 1024
MAX_BLOCK_SIZE = 1 << 16
_NAME = r"^[!-~]{1,256}$"
"""Engine and request ids: printable ASCII without spaces (``report_key`` joins two with a space)."""
_HOST = r"^[A-Za-z0-9._:\-\[\]%]{1,255}$"
_MAC = r"^[0-9a-f]{64}$"
_EPOCH = r"^[0-9a-f]{1,64}$"


class KVTransferParams(BaseModel):
    """Where a request's prompt KV lies on a prefill engine, as our prefill side issued it: the decode side's
    parse of ``kv_transfer_params``, every field checked for type and range. Extra keys (the proxy's
    ``pdserve_release``, ``pdserve_report``) are ignored here; the MAC (``contract.auth.check_params``)
    covers the raw fields a decode engine acts on."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    remote_engine_id: Annotated[StrictStr, Field(pattern=_NAME)]
    remote_request_id: Annotated[StrictStr, Field(pattern=_NAME)]
    remote_host: Annotated[StrictStr, Field(pattern=_HOST)]
    remote_port: Annotated[StrictInt, Field(ge=1, le=65535)]
    remote_block_ids: Annotated[
        tuple[Annotated[StrictInt, Field(ge=0, le=MAX_BLOCK_ID)], ...], Field(min_length=1, max_length=MAX_BLOCK_IDS)
    ]
    remote_num_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    tp_size: Annotated[StrictInt, Field(ge=1, le=MAX_TP_SIZE)] = 1
    block_size: Annotated[StrictInt, Field(ge=1, le=MAX_BLOCK_SIZE)] | None = None
    """The prefill's (logical) block size; None from a prefill that did not say."""
    pdserve_expires: Annotated[float, Field(allow_inf_nan=False, strict=True)] | None = None
    """When the lease on these blocks ends at the earliest (unix s, the prefill host's clock)."""
    pdserve_reader: Annotated[StrictStr, Field(pattern=_NAME)] | None = None
    pdserve_epoch: Annotated[StrictStr, Field(pattern=_EPOCH)] | None = None
    """The start of the prefill engine that issued these (its mappings of another start are never read)."""
    pdserve_mac: Annotated[StrictStr, Field(pattern=_MAC)] | None = None

    @field_validator("remote_block_ids", mode="before")
    @classmethod
    def _one_group(cls, value: Any) -> Any:
        # vLLM's own connector sends one list per KV cache group; accept that shape for one group.
        if isinstance(value, list | tuple) and value and isinstance(value[0], list | tuple):
            if len(value) != 1:
                raise ValueError(f"{len(value)} KV cache groups; only 1 is supported")
            return value[0]
        return value

    @model_validator(mode="after")
    def _ports_exist(self) -> KVTransferParams:
        if self.remote_port + self.tp_size - 1 > 65535:
            raise ValueError(f"remote_port {self.remote_port} + tp_size {self.tp_size} passes port 65535")
        return self

    def side_channel(self, rank: int) -> str:
        """The side channel of the prefill engine's TP rank ``rank`` (handshake, release)."""
        return side_channel_endpoint(self.remote_host, self.remote_port, rank)


class InvalidTransferParams(ValueError):
    """``kv_transfer_params`` that ask for a transfer but are not well-formed; the message names the fields."""


def asks_remote_prefill(raw: object) -> bool:
    """Whether a request's ``kv_transfer_params`` (anything a client could have put there) ask to load KV."""
    return isinstance(raw, Mapping) and raw.get(DO_REMOTE_PREFILL) is True


def asks_remote_decode(raw: object) -> bool:
    """Whether a prefill request's ``kv_transfer_params`` ask to keep its KV for a decode engine."""
    return isinstance(raw, Mapping) and raw.get(DO_REMOTE_DECODE) is True


def parse_remote_prefill(raw: object) -> KVTransferParams | None:
    """The checked parameters of a request that asks to load remote KV; None if it does not ask.

    Never raises anything but ``InvalidTransferParams`` (a ``ValueError``), whatever ``raw`` is: a wrong
    type, a missing field, a value out of range, a giant list.
    """
    if not asks_remote_prefill(raw):
        return None
    raw = cast(Mapping[str, Any], raw)
    missing = [name for name in REMOTE_PREFILL_REQUIRED if raw.get(name) in (None, "")]
    if missing:
        raise InvalidTransferParams(f"kv_transfer_params with do_remote_prefill lack {', '.join(missing)}")
    try:
        return KVTransferParams.model_validate(dict(raw))
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or 'params'}: {error['msg']}" for error in e.errors()[:3]
        )
        raise InvalidTransferParams(f"invalid kv_transfer_params: {problems}") from None
    except (TypeError, ValueError) as e:
        raise InvalidTransferParams(f"invalid kv_transfer_params: {e}") from None


def reader_named(raw: object) -> str | None:
    """The decode engine a prefill request's parameters name as their reader (``pdserve_reader``), if valid."""
    if not isinstance(raw, Mapping):
        return None
    reader = raw.get(PDSERVE_READER)
    return reader if isinstance(reader, str) and re.fullmatch(_NAME, reader) else None


PREFILL_REQUEST_PARAMS = {
    DO_REMOTE_DECODE: True,
    DO_REMOTE_PREFILL: False,
    REMOTE_ENGINE_ID: None,
    REMOTE_BLOCK_IDS: None,
    REMOTE_HOST: None,
    REMOTE_PORT: None,
}
"""What the proxy sends a prefill engine: compute the prompt, keep its KV for a decode engine."""

# --- what an engine's KV cache holds, for the proxy --------------------------------------------
KV_EVENTS_PATH = "/v1/pdserve/kv_events"
"""``GET`` with ``?after=N``: the engine's KV events from batch ``N + 1`` on, one JSON line each
(``connectors.kv_events``). Under ``/v1``, so vLLM's key check (the cluster's engine key) guards it."""

# --- an engine's KV tier, asked by the proxy -------------------------------------------------
TIER_HELD_PATH = "/v1/pdserve/tier_held"
"""``POST`` a chat request's body (``messages``) or a completion request's (``prompt``) here: the engine answers how
many of its prompt's tokens its KV tiers hold (``connectors.tier.held``). Under ``/v1``, so vLLM's key check
(the cluster's engine key) guards it like the completions routes."""
BLOCKS = "blocks"
"""The answer: the prompt's full blocks at the engine's block size, each named as its KV events name it (the low 64
bits of vLLM's block hash; ``connectors.kv_events``); empty where the engine cannot hash it as its scheduler does."""
PROMPT_TOKENS = "prompt_tokens"
"""The answer: the prompt's length in tokens, as the engine renders and tokenizes it."""
TIERS = "tiers"
"""The answer: per tier name (``shared``, ``node``), how many leading prompt tokens it holds (whole chunks)."""
SHARED_TIER = "shared"
"""The tier every engine of the cluster reads (``kv_tier.shared_path``); ``node`` is one node's."""
