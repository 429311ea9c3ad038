"""The orchestrator's exception tree: every error it raises on purpose is a PdserveError."""

from __future__ import annotations


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
