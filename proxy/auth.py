"""API keys: where they come from, and checking the one a request presents.

Keys are never written in a config: a config names environment variables
(``api_key_env``) or a file of one key per line (``api_key_file``), and
``load_keys`` reads them when the app is built, in the process that serves
it. ``KeyCheck`` compares a presented key with every configured one in
constant time (``hmac.compare_digest``), so the time an answer takes says
nothing about how much of a key was right.

Clients present a key as ``Authorization: Bearer <key>`` (what the OpenAI
clients send); the admin routes also take ``X-Admin-Key: <key>``.
"""

from __future__ import annotations

import hmac
import os
import re
from collections.abc import Iterable
from pathlib import Path

from contract import auth as cluster_auth
from proxy.errors import ProxyConfigError

__all__ = ["ENV_NAME", "KeyCheck", "bearer_token", "load_engine_key", "load_keys"]

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
"""What an environment variable's name looks like (and a secret, usually, does not)."""


def load_keys(env_names: Iterable[str] = (), file: str | None = None) -> tuple[bytes, ...]:
    """The keys the variables ``env_names`` and the lines of ``file`` hold; ``ProxyConfigError`` if one is missing."""
    keys: list[str] = []
    for name in env_names:
        if not ENV_NAME.fullmatch(name):
            raise ProxyConfigError(
                "an API key variable is not the name of an environment variable (never write a key there)"
            )
        value = os.environ.get(name, "").strip()
        if not value:
            raise ProxyConfigError(f"environment variable {name} (an API key) is not set or empty")
        keys.append(value)
    if file is not None:
        try:
            lines = Path(file).read_text().splitlines()
        except OSError as e:
            raise ProxyConfigError(f"cannot read the API key file {file}: {e}") from e
        from_file = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not from_file:
            raise ProxyConfigError(f"the API key file {file} holds no key")
        keys += from_file
    return tuple(key.encode() for key in keys)


def load_engine_key() -> str:
    """The engines' key from this process's environment (``contract.auth.load_engine_key``): the key itself
    (``PDSERVE_ENGINE_KEY``, what the cluster's proxy actor is given: never the cluster secret), a file of it,
    or else derived from the cluster secret (a proxy started by hand with ``--cluster-secret-file``).
    ``ProxyConfigError`` naming where it is looked for if there is none."""
    try:
        return cluster_auth.load_engine_key()
    except cluster_auth.MissingSecret as e:
        raise ProxyConfigError(str(e)) from e


def bearer_token(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, or None."""
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class KeyCheck:
    """Whether a presented key is one of ``keys``; with no keys, every request is allowed."""

    __slots__ = ("keys",)

    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self.keys = keys

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def allows(self, presented: str | None) -> bool:
        if not self.keys:
            return True
        if presented is None:
            return False
        candidate = presented.encode()
        matched = False
        for key in self.keys:  # every key compared, whichever matches
            matched |= hmac.compare_digest(candidate, key)
        return matched
