"""The controller's HTTP API: one definition of its routes, its token and its status schema, and the client.

``pdserve up`` creates the controller (a Ray actor), which serves this API on
its node (``orchestrator.control_server``); the endpoint and a per-cluster
token go into the state file (mode 0600), and from then on ``pdserve status``,
``scale`` and ``down`` are one HTTP call each: no Ray driver, no Ray import.
The controller holds only the token's SHA-256, so the token itself never
leaves the state file (it is neither printed nor logged nor an actor argument).

Routes (every one needs ``Authorization: Bearer <token>``; 401 without it):

- ``GET  /v1/status``: the cluster as ``pdserve status --json`` prints it,
  schema ``STATUS_SCHEMA`` (fields in ``STATUS_FIELDS``, README "Status schema").
- ``POST /v1/scale``  ``{"targets": {"prefill": N, "decode": M}}``: the plan, or 409 with the reason.
- ``POST /v1/move``   ``{"from": "prefill", "to": "decode", "count": N}``: ready engines change pool without a
  restart; the plan, or 409 with the reason.
- ``POST /v1/shutdown``: stops engines and proxy, answers, then the controller exits.

This module imports only the standard library: it is on every CLI call's path.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from orchestrator.errors import ClusterNotRunning, PdserveError

__all__ = [
    "STATUS_FIELDS",
    "STATUS_SCHEMA",
    "ControlClient",
    "ControlError",
    "new_token",
    "token_digest",
    "token_matches",
]

STATUS_PATH = "/v1/status"
SCALE_PATH = "/v1/scale"
MOVE_PATH = "/v1/move"
SHUTDOWN_PATH = "/v1/shutdown"
HEALTH_PATH = "/health"  # no token: says only that the API is up

STATUS_SCHEMA = "pdserve-status/1"
# The stable part of ``pdserve status --json``: field -> JSON type(s). Fields may be added; none of these
# is removed or changes type within one schema version.
STATUS_FIELDS: dict[str, tuple[type, ...]] = {
    "schema": (str,),
    "name": (str,),
    "model": (str,),
    "connector": (str,),
    "phase": (str,),  # created | starting | ready | failed | stopping | stopped
    "error": (str, type(None)),
    "proxy_url": (str,),
    "started_at": (float, int),
    "ready_s": (float, int, type(None)),
    "log_dir": (str,),
    "controller": (dict,),  # pid, restarts (Ray restarts of the controller), api_url
    "pools": (dict,),  # role -> target, max, ready, draining
    "engines": (list,),  # ENGINE_FIELDS each
    "hosts": (list,),  # HOST_FIELDS each: the Ray cluster's nodes
    "autoscaler": (dict, type(None)),  # interval_s, decisions, changes; None when off (several models: in models)
    "models": (list,),  # MODEL_FIELDS each, one per model the cluster serves
    "moves": (list,),  # the last moves done: {engine_id, from, to, at, finishing_s, switch_s}
    "events": (list,),  # {"t": unix time, "message": str}, oldest first
}
ENGINE_FIELDS: dict[str, tuple[type, ...]] = {
    "engine_id": (str,),
    "model": (str,),  # the served name of its model
    "role": (str,),  # prefill | decode
    "state": (str,),  # pending | starting | ready | moving | draining | restarting | failed | stopped
    "moving_from": (str, type(None)),  # moving: the pool whose work it finishes; it then serves in its role
    "url": (str,),
    "host": (str,),  # the address other hosts reach it at ("" until it started)
    "kv_endpoints": (list,),  # its connector's side channel, one tcp://host:port per TP rank
    "pid": (int, type(None)),
    "cpu_bind": (str, type(None)),
    "load_s": (float, int, type(None)),
    "phases": (list,),  # its start's phases so far: {"phase": str, "s": seconds since it was asked for}
    "restarts": (int,),
    "failures": (int,),  # starts that failed in a row (a failed engine starts again after a back-off)
    "error": (str, type(None)),
    "log_path": (str,),
    "kept_warm": (bool,),  # drained, waiting for autoscaling.keep_warm_s (state draining)
    # pdserve:kv_quarantined_blocks_total on its /metrics; None: not running, no answer within 2 s, or not counted
    "kv_quarantined_blocks": (int, type(None)),
}
HOST_FIELDS: dict[str, tuple[type, ...]] = {
    "ip": (str,),
    "alive": (bool,),
    "head": (bool,),
    "labels": (dict,),  # the node's own labels (Ray's ray.io/* left out)
    "engines": (list,),  # engine ids whose address is this host's
}
MODEL_FIELDS: dict[str, tuple[type, ...]] = {
    "name": (str,),  # the served name clients send as 'model'
    "key": (str,),  # the prefix of its engines' ids ("" in a cluster of one model)
    "pools": (dict,),  # role -> POOL_FIELDS, of this model's engines
    "autoscaler": (dict, type(None)),
}
POOL_FIELDS: dict[str, tuple[type, ...]] = {
    "target": (int,),
    "max": (int,),
    "ready": (int,),
    "moving": (int,),  # engines moving into the pool, still finishing the other pool's work
    "draining": (int,),
}


def cluster_status(
    controller: Any, nodes: list[Any] | None, kv_quarantined: Mapping[str, int | None] | None = None
) -> dict[str, Any]:
    """The document ``GET /v1/status`` answers (``STATUS_FIELDS``): the controller's state, and ``nodes``
    (``placement.Node``, Ray's; None when the GCS did not answer) with the engines on each. ``pools`` counts
    every model's engines; ``models`` has each model's pools (and autoscaler) apart. ``kv_quarantined``: the KV
    blocks each engine's /metrics says it quarantined, by engine id (an engine not in it: null)."""
    from contract.wire import ROLES
    from orchestrator.engine_record import engine_status

    spec, records = controller.spec, controller.records()
    models = [
        {
            "name": name,
            "key": group.pools.spec.key,
            "pools": _pools(group.pools),
            "autoscaler": group.autoscaler.status() if group.autoscaler is not None else None,
        }
        for name, group in controller.groups.items()
    ]
    pools = {role: {f: sum(m["pools"][role][f] for m in models) for f in POOL_FIELDS} for role in ROLES}
    return {
        "schema": STATUS_SCHEMA,
        "name": spec.name,
        "model": spec.model_name,
        "connector": spec.connector,
        "phase": controller.phase,
        "error": controller.error,
        "proxy_url": controller.proxy.url,
        "started_at": controller.started_at,
        "ready_s": controller.ready_s,
        "log_dir": str(controller.log_dir),
        "controller": {"pid": os.getpid(), "restarts": controller.restarts, "api_url": controller.api.url},
        "engines": [engine_status(r, (kv_quarantined or {}).get(r.engine_id)) for r in records],
        "hosts": _hosts(nodes or [], records),
        "pools": pools,
        "autoscaler": models[0]["autoscaler"] if len(models) == 1 else None,
        "models": models,
        "moves": sorted((m for g in controller.groups.values() for m in g.pools.moves), key=lambda m: m.get("at", 0)),
        "events": controller.log.events,
    }


def _pools(pools: Any) -> dict[str, dict[str, int]]:
    """Each role's POOL_FIELDS of one model's ``Pools``."""
    from contract.wire import ROLES

    records = list(pools.engines.values())
    return {
        role: {
            "target": pools.targets[role],
            "max": pools.spec.max_replicas(role),
            "ready": sum(r.state == "ready" for r in records if r.role == role),
            "moving": sum(r.state == "moving" for r in records if r.role == role),
            "draining": sum(r.state == "draining" for r in records if r.role == role),
        }
        for role in ROLES
    }


def _hosts(nodes: list[Any], records: list[Any]) -> list[dict[str, Any]]:
    """Ray's nodes and the engines on each (a lost host shows ``alive: false``)."""
    latest: dict[str, Any] = {}
    for node in nodes:  # a host that came back is a new node at the same address: show the live one
        if node.ip not in latest or node.alive:
            latest[node.ip] = node
    return [
        {
            "ip": node.ip,
            "alive": node.alive,
            "head": node.is_head,
            "labels": {k: v for k, v in node.labels.items() if not k.startswith("ray.io/")},
            "engines": [r.engine_id for r in records if r.host == node.ip],
        }
        for node in sorted(latest.values(), key=lambda n: n.ip)
    ]


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_digest(token: str) -> str:
    """What the controller keeps of the token: its SHA-256, hex."""
    return hashlib.sha256(token.encode()).hexdigest()


def token_matches(authorization: str | None, digest: str) -> bool:
    """Whether an ``Authorization: Bearer <token>`` header carries the token of ``digest`` (constant time)."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    return hmac.compare_digest(token_digest(token.strip()), digest)


class ControlError(PdserveError):
    """The controller answered with an error (its words), or answered something that is not its API."""


class ControlClient:
    """The CLI's side of the API: one HTTP request per call, standard library only."""

    def __init__(self, url: str, token: str, timeout_s: float = 30.0):
        self.url, self._token, self.timeout_s = url.rstrip("/"), token, timeout_s

    def status(self) -> dict[str, Any]:
        return self._call("GET", STATUS_PATH)

    def scale(self, targets: dict[str, int], reason: str = "by hand", model: str | None = None) -> dict[str, Any]:
        return self._call("POST", SCALE_PATH, {"targets": targets, "reason": reason, "model": model})

    def move(
        self, source: str, destination: str, count: int = 1, reason: str = "by hand", model: str | None = None
    ) -> dict[str, Any]:
        body = {"from": source, "to": destination, "count": count, "reason": reason, "model": model}
        return self._call("POST", MOVE_PATH, body)

    def shutdown(self, timeout_s: float = 180.0) -> dict[str, Any]:
        return self._call("POST", SHUTDOWN_PATH, {}, timeout_s=timeout_s)

    def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self._token}")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            raise ControlError(f"the controller at {self.url} refused {method} {path}: {_error_text(e)}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            reason = getattr(e, "reason", e)
            raise ClusterNotRunning(f"the controller at {self.url} does not answer ({reason})") from None
        except json.JSONDecodeError as e:
            raise ControlError(f"the controller at {self.url} answered {method} {path} with no JSON: {e}") from None


def _error_text(error: urllib.error.HTTPError) -> str:
    try:
        return json.loads(error.read())["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {error.code}"
