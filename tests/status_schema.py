"""The check of ``pdserve status --json`` against its schema (``orchestrator.control.STATUS_SCHEMA`` and its
field tables), for the unit and integration tests."""

from __future__ import annotations

from typing import Any

from orchestrator.control import (
    ENGINE_FIELDS,
    HOST_FIELDS,
    MODEL_FIELDS,
    POOL_FIELDS,
    STATUS_FIELDS,
    STATUS_SCHEMA,
)


def schema_problems(status: dict[str, Any]) -> list[str]:
    """What in ``status`` breaks ``STATUS_SCHEMA``, in words; empty when it holds."""
    problems = _field_problems("", status, STATUS_FIELDS)
    if status.get("schema") not in (None, STATUS_SCHEMA):
        problems.append(f"schema is {status.get('schema')!r}, expected {STATUS_SCHEMA!r}")
    for i, engine in enumerate(status.get("engines") or []):
        problems += _field_problems(f"engines.{i}.", engine, ENGINE_FIELDS)
    for role, pool in (status.get("pools") or {}).items():
        problems += _field_problems(f"pools.{role}.", pool, POOL_FIELDS)
    for i, model in enumerate(status.get("models") or []):
        problems += _field_problems(f"models.{i}.", model, MODEL_FIELDS)
    for i, host in enumerate(status.get("hosts") or []):
        problems += _field_problems(f"hosts.{i}.", host, HOST_FIELDS)
    return problems


def _field_problems(prefix: str, doc: dict[str, Any], fields: dict[str, tuple[type, ...]]) -> list[str]:
    problems = []
    for name, types in fields.items():
        if name not in doc:
            problems.append(f"{prefix}{name} is missing")
        elif not isinstance(doc[name], types) or (isinstance(doc[name], bool) and bool not in types):
            expected = "/".join(t.__name__ for t in types)
            problems.append(f"{prefix}{name} is {type(doc[name]).__name__}, expected {expected}")
    return problems
