"""Spec files edited for a run: a temporary copy of a spec with some of its settings replaced."""

from __future__ import annotations

import os
import tempfile

import yaml


def spec_copy(config: str, **autoscaling: object) -> str:
    """A temporary copy of the spec file at ``config`` with its ``autoscaling`` section dropped
    (``autoscaling=None``) or some of its fields replaced; its path."""
    with open(config) as f:
        raw = yaml.safe_load(f)
    if "autoscaling" in autoscaling and autoscaling["autoscaling"] is None:
        raw.pop("autoscaling", None)
    else:
        raw["autoscaling"] = raw.get("autoscaling", {}) | autoscaling
    fd, path = tempfile.mkstemp(suffix=".yaml", prefix="validate-simulator-")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(raw, f)
    return path
