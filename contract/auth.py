"""The cluster's secret, and what it authenticates: side-channel messages and issued transfer parameters.

One secret per cluster (``pdserve up`` makes it: 32 random bytes, URL-safe
text). It reaches a process only through the environment
(``PDSERVE_CLUSTER_SECRET``) or a file named by ``PDSERVE_CLUSTER_SECRET_FILE``;
it is never printed, logged or written into a config or a command line. Two
keys are derived from it (HMAC-SHA256 with a fixed label each), so holding one
does not give the other:

- the **engine key** (``engine_key``): the key of every engine's HTTP server
  (vLLM's ``VLLM_API_KEY``; ``orchestrator.engine_guard`` asks it on every
  route but ``/health`` and ``/metrics``). The proxy holds this key and no
  other (``PDSERVE_ENGINE_KEY``), so only the proxy can call an engine.
- the **KV key** (``KVAuth``): engines only. It seals every side-channel
  message (handshake, its answer, release, report query, ping) and MACs the
  ``kv_transfer_params`` a prefill engine issues.

The KV tier's entries are MAC'd under a key of the tier's own, kept in its
directory (``connectors.tier.key``), not under one of this secret: the secret is
new at every ``pdserve up``, and the tier outlives the cluster.

A sealed message is ASCII framing around its body (so a sealed release or
report query travels in JSON as a string; the proxy sends it unchanged)::

    PDS1 <kind> <expires, unix ms> <HMAC-SHA256 hex of "kind expires body"> <body>

``open`` refuses a wrong MAC, an expired message, one that claims to live
longer than ``MAX_MESSAGE_TTL_S`` and an unknown kind (``Unauthenticated``).
Live messages (a handshake, a decode engine's own release) live
``LIVE_TTL_S``; the release and report query a prefill engine hands the proxy
live as long as the request's lease. A handshake carries a nonce its answer
must echo, so an answer cannot be replayed to another asker.

Transfer parameters: the prefill engine adds ``pdserve_expires`` (its lease's
end, unix s) and ``pdserve_reader`` (the decode engine the proxy chose, when
it said) and ``pdserve_mac`` over every field a decode engine acts on; the
decode engine checks it (``check_params``) before it connects anywhere, and
refuses parameters it already used (``ConsumedParams``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from contract import wire
from contract.errors import ContractError
from contract.private_files import make_private_dirs, write_private

__all__ = [
    "LIVE_TTL_S",
    "MACED_FIELDS",
    "MAX_MESSAGE_TTL_S",
    "PROXY_ENGINE_KEY_ENV",
    "PROXY_ENGINE_KEY_FILE_ENV",
    "EXPIRED_REASON",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "ClusterSecret",
    "ConsumedParams",
    "EngineKey",
    "KVAuth",
    "MissingSecret",
    "Unauthenticated",
    "engine_key",
    "load_engine_key",
    "load_secret",
    "new_secret",
    "write_secret",
]

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
SECRET_FILE_ENV = "PDSERVE_CLUSTER_SECRET_FILE"
PROXY_ENGINE_KEY_ENV = "PDSERVE_ENGINE_KEY"
"""The engine key itself, for a process that calls engines and nothing else (the proxy): it holds no secret
from which the KV key, or any other, could be derived. The cluster's proxy actor gets only this."""
PROXY_ENGINE_KEY_FILE_ENV = "PDSERVE_ENGINE_KEY_FILE"
"""A file holding the engine key (``pdserve secret PATH --engine-key-file OUT`` writes one)."""
ENGINE_KEY_ENV = "VLLM_API_KEY"
"""Where vLLM's server takes its ``--api-key`` from (so the key is on no command line)."""

SEALED_MAGIC = b"PDS1"
KINDS = (b"handshake", b"handshake-reply", b"release", b"report", b"ping", b"read", b"pin")
LIVE_TTL_S = 60.0
"""How long a message made for sending now is valid (clocks of the cluster's hosts may differ by this much)."""
MAX_MESSAGE_TTL_S = 24 * 3600.0
_MIN_SECRET_BYTES = 16
_ENGINE_KEY_LABEL = b"pdserve engine api key v1"
_KV_KEY_LABEL = b"pdserve kv plane v1"
_MAC_HEX = 64
EXPIRED_REASON = "expired"
"""How ``check_params`` starts its reason for genuine parameters whose lease is over."""


class MissingSecret(ContractError):
    """No cluster secret where one is needed; the message says where it is looked for."""


class Unauthenticated(ContractError):
    """A message or transfer parameters failed authentication; ``kind`` labels what was refused."""

    def __init__(self, kind: str, reason: str):
        self.kind = kind
        self.reason = reason
        super().__init__(f"unauthenticated {kind}: {reason}")

    def __reduce__(self):
        return (type(self), (self.kind, self.reason))


class ClusterSecret:
    """The secret, in a wrapper that never shows it (``repr``, ``str``, logs, tracebacks, Ray's dashboard)."""

    __slots__ = ("_value",)
    _WHAT = "the cluster secret"

    def __init__(self, value: str) -> None:
        value = value.strip()
        if len(value.encode()) < _MIN_SECRET_BYTES:
            raise MissingSecret(f"{self._WHAT} is too short ({len(value)} characters; at least 16)")
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return f"{type(self).__name__}(****)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and hmac.compare_digest(self._value, other._value)  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(hashlib.sha256(self._value.encode()).digest())

    def __reduce__(self):  # crosses to Ray actors as an argument: never through the environment of a runtime_env
        return (type(self), (self._value,))


def new_secret() -> ClusterSecret:
    return ClusterSecret(secrets.token_urlsafe(32))


def write_secret(path: Path, secret: ClusterSecret) -> None:
    """Write ``secret`` to ``path`` (mode 0600, created anew; missing parents 0700)."""
    make_private_dirs(path.parent)
    write_private(path, secret.reveal() + "\n")


def read_secret_file(path: str | Path) -> ClusterSecret:
    try:
        return ClusterSecret(Path(path).read_text())
    except OSError as e:
        raise MissingSecret(f"cannot read the cluster secret file {path}: {e.strerror or e}") from e


def load_secret(environ: Mapping[str, str] | None = None) -> ClusterSecret:
    """The secret from ``PDSERVE_CLUSTER_SECRET``, else from the file ``PDSERVE_CLUSTER_SECRET_FILE`` names."""
    environ = os.environ if environ is None else environ
    if value := environ.get(SECRET_ENV, "").strip():
        return ClusterSecret(value)
    if path := environ.get(SECRET_FILE_ENV, "").strip():
        return read_secret_file(path)
    raise MissingSecret(
        f"no cluster secret: set {SECRET_ENV}, or {SECRET_FILE_ENV} to a file holding it "
        "(`pdserve secret FILE` makes one; `pdserve up` makes and hands out its own)"
    )


def _derive(secret: ClusterSecret, label: bytes) -> bytes:
    return hmac.new(secret.reveal().encode(), label, hashlib.sha256).digest()


def engine_key(secret: ClusterSecret) -> str:
    """The engines' HTTP API key (``--api-key``) derived from the cluster secret."""
    return _derive(secret, _ENGINE_KEY_LABEL).hex()


# The fields of kv_transfer_params a decode engine acts on, in MAC order.
MACED_FIELDS = (
    wire.REMOTE_ENGINE_ID,
    wire.REMOTE_REQUEST_ID,
    wire.REMOTE_HOST,
    wire.REMOTE_PORT,
    wire.REMOTE_BLOCK_IDS,
    wire.REMOTE_NUM_TOKENS,
    wire.TP_SIZE,
    wire.BLOCK_SIZE,
    wire.PDSERVE_EXPIRES,
    wire.PDSERVE_READER,
    wire.PDSERVE_EPOCH,
)


class KVAuth:
    """Seals and opens side-channel messages, MACs and checks transfer parameters, with the KV key."""

    __slots__ = ("_key",)

    def __init__(self, secret: ClusterSecret) -> None:
        self._key = _derive(secret, _KV_KEY_LABEL)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KVAuth:
        return cls(load_secret(environ))

    def __repr__(self) -> str:
        return "KVAuth(****)"

    def _mac(self, data: bytes) -> bytes:
        return hmac.new(self._key, data, hashlib.sha256).hexdigest().encode()

    # ---------------------------------------------------------------- messages

    def seal(self, kind: bytes, body: bytes, ttl_s: float = LIVE_TTL_S, now: float | None = None) -> bytes:
        if kind not in KINDS:
            raise ValueError(f"unknown side-channel message kind {kind!r}")
        expires = str(int(((time.time() if now is None else now) + ttl_s) * 1000)).encode()
        signed = kind + b" " + expires + b" " + body
        return SEALED_MAGIC + b" " + kind + b" " + expires + b" " + self._mac(signed) + b" " + body

    def open(self, message: bytes, now: float | None = None) -> tuple[bytes, bytes]:
        """``(kind, body)`` of a sealed message; ``Unauthenticated`` if it is not one of ours, now."""
        parts = message.split(b" ", 4)
        if len(parts) != 5 or parts[0] != SEALED_MAGIC:
            raise Unauthenticated("message", "not a sealed pdserve message")
        _, kind, expires, mac, body = parts
        label = kind.decode(errors="replace") if kind in KINDS else "message"
        if kind not in KINDS or len(mac) != _MAC_HEX or not expires.isdigit():
            raise Unauthenticated(label, "malformed framing")
        if not hmac.compare_digest(mac, self._mac(kind + b" " + expires + b" " + body)):
            raise Unauthenticated(label, "wrong MAC (another cluster's secret, or altered)")
        left_s = int(expires) / 1000 - (time.time() if now is None else now)
        if left_s < 0:
            raise Unauthenticated(label, f"expired {-left_s:.1f} s ago")
        if left_s > MAX_MESSAGE_TTL_S:
            raise Unauthenticated(label, "claims to live longer than any message may")
        return kind, body

    # ---------------------------------------------------------------- transfer parameters

    def _params_mac(self, params: Mapping[str, Any]) -> str:
        fields = [params.get(name) for name in MACED_FIELDS]
        canonical = json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()
        return self._mac(b"params " + canonical).decode()

    def sign_params(self, params: dict[str, Any], ttl_s: float, now: float | None = None) -> dict[str, Any]:
        """``params`` with ``pdserve_expires`` (now + ``ttl_s``) and ``pdserve_mac`` added."""
        params[wire.PDSERVE_EXPIRES] = round((time.time() if now is None else now) + ttl_s, 3)
        params[wire.PDSERVE_MAC] = self._params_mac(params)
        return params

    def check_params(self, params: Mapping[str, Any], reader: str, now: float | None = None) -> None:
        """Raise ``Unauthenticated("params", why)`` unless ``params`` are as a prefill engine of this cluster
        issued them, unexpired, and for ``reader`` (when they name one)."""
        mac = params.get(wire.PDSERVE_MAC)
        if not isinstance(mac, str) or len(mac) != _MAC_HEX:
            raise Unauthenticated("params", "no MAC (not issued by a prefill engine of this cluster)")
        try:
            expected = self._params_mac(params)
        except (TypeError, ValueError) as e:
            raise Unauthenticated("params", f"fields cannot be encoded: {e}") from e
        if not hmac.compare_digest(mac.encode(), expected.encode()):
            raise Unauthenticated("params", "wrong MAC (forged, altered, or another cluster's)")
        expires = params.get(wire.PDSERVE_EXPIRES)
        if not isinstance(expires, int | float) or isinstance(expires, bool):
            raise Unauthenticated("params", "no expiry")
        if (time.time() if now is None else now) > expires:
            raise Unauthenticated("params", EXPIRED_REASON + " (the prefill's lease is over)")
        named = params.get(wire.PDSERVE_READER)
        if named is not None and named != reader:
            raise Unauthenticated("params", f"issued for decode engine {named}, not {reader}")


class ConsumedParams:
    """The MACs of transfer parameters a decode engine already acted on, until they expire: a replay is refused."""

    def __init__(self, limit: int = 65536) -> None:
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def claim(self, params: Mapping[str, Any], now: float | None = None) -> bool:
        """True the first time these (checked) parameters are claimed, False after."""
        now = time.time() if now is None else now
        mac, expires = str(params.get(wire.PDSERVE_MAC)), float(params.get(wire.PDSERVE_EXPIRES) or 0)
        with self._lock:
            while self._seen and (next(iter(self._seen.values())) < now or len(self._seen) >= self._limit):
                self._seen.popitem(last=False)
            if mac in self._seen:
                return False
            self._seen[mac] = expires
            return True


class EngineKey(ClusterSecret):
    """The engine key in the same wrapper; what the controller hands the proxy actor instead of the cluster
    secret (``EngineKey.of(secret)``): from it no other key can be derived."""

    __slots__ = ()
    _WHAT = "the engine key"

    @classmethod
    def of(cls, secret: ClusterSecret) -> EngineKey:
        return cls(engine_key(secret))


def load_engine_key(environ: Mapping[str, str] | None = None) -> str:
    """The engine key of a process that calls engines: ``PDSERVE_ENGINE_KEY``, else the file
    ``PDSERVE_ENGINE_KEY_FILE`` names, else derived from the cluster secret (``load_secret``: a proxy started
    by hand with the secret file). ``MissingSecret`` names every place it is looked for."""
    environ = os.environ if environ is None else environ
    if value := environ.get(PROXY_ENGINE_KEY_ENV, "").strip():
        return EngineKey(value).reveal()
    if path := environ.get(PROXY_ENGINE_KEY_FILE_ENV, "").strip():
        try:
            return EngineKey(Path(path).read_text()).reveal()
        except OSError as e:
            raise MissingSecret(f"cannot read the engine key file {path}: {e.strerror or e}") from e
    if environ.get(SECRET_ENV, "").strip() or environ.get(SECRET_FILE_ENV, "").strip():
        return engine_key(load_secret(environ))
    raise MissingSecret(
        f"no engine key: set {PROXY_ENGINE_KEY_ENV}, or {PROXY_ENGINE_KEY_FILE_ENV} to a file holding it "
        f"(`pdserve secret FILE --engine-key-file OUT` writes one), or give the cluster secret ({SECRET_ENV}, "
        f"or {SECRET_FILE_ENV} to a file holding it) to derive it from"
    )
