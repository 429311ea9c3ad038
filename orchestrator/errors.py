"""The orchestrator's exception tree: every error it raises on purpose is a PdserveError."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import ValidationError


class PdserveError(Exception):
    """Base of every error the orchestrator raises on purpose."""


class SpecError(PdserveError):
    """A cluster spec is wrong: names the file, the field and the reason."""

    def __init__(self, source: str, field: str, reason: str, more: list[tuple[str, str]] | None = None):
        self.source, self.field, self.reason = source, field, reason
        self.more = more or []
        lines = [f"{source}: {field}: {reason}" if field else f"{source}: {reason}"]
        lines += [f"{source}: {f}: {r}" for f, r in self.more]
        super().__init__("\n".join(lines))

    def __reduce__(self):  # crosses Ray's process boundary intact
        return (type(self), (self.source, self.field, self.reason, self.more))

    @classmethod
    def of(cls, source: str, error: ValidationError, prefix: str = "") -> SpecError:
        """Every problem pydantic found in a settings file, each named by its dotted field (after ``prefix``)."""
        problems = []
        for item in error.errors():
            loc = [prefix] if prefix else []
            loc += [str(part) for part in item["loc"]]
            ctx_error = (item.get("ctx") or {}).get("error")
            if isinstance(ctx_error, FieldError):
                problems.append((".".join([*loc, ctx_error.field]), ctx_error.reason))
                continue
            reason = item["msg"]
            if item["type"] == "extra_forbidden":
                reason = "unknown key"
            elif item["type"] == "missing":
                reason = "required field is missing"
            elif (item.get("ctx") or {}).get("hide_input"):
                pass  # it may be a secret written where its variable's name belongs
            elif "input" in item and item["type"] not in ("model_type", "dict_type"):
                reason = f"{reason} (got {item['input']!r})"
            problems.append((".".join(loc), reason))
        field, reason = problems[0]
        return cls(source, field, reason, more=problems[1:])


class FieldError(ValueError):
    """Raised inside a model validator to blame one of its fields (``SpecError.of`` names it by its whole path)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def read_mapping(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A YAML (or JSON) file's top-level mapping; ``SpecError`` naming the file if it cannot be one."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SpecError(str(path), "", f"cannot read file: {e.strerror}") from e
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError(str(path), "", f"not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise SpecError(str(path), "", "the file must hold a YAML mapping")
    return raw


class EngineStartError(PdserveError):
    """An engine could not start; carries the engine's own error text."""

    def __init__(self, engine_id: str, detail: str):
        self.engine_id, self.detail = engine_id, detail
        super().__init__(f"engine {engine_id} failed to start:\n{detail}")

    def __reduce__(self):
        return (type(self), (self.engine_id, self.detail))


class ClusterNotRunning(PdserveError):
    """No pdserve cluster is recorded as running in this state directory."""


class ProfilingError(PdserveError):
    """Measuring a running cluster's engines failed (``pdserve profile``): names the engine or option and why."""
