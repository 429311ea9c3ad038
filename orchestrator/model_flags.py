"""Command-line flags generated from a settings model, so that a setting is defined once.

``add_model_flags(parser, Model)`` adds one flag per field of a pydantic model
(nested models flattened: ``routing.prefill`` is ``--routing-prefill``), with
the field's description as help and its default said; each value is checked by
the field's own type and bounds as argparse parses it. ``given(args)`` is what
the command line set, as the model's nested mapping, to lay over a file's
(``overlay``) before the model validates the whole.
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

__all__ = ["ModelFlag", "add_model_flags", "given", "model_flags", "overlay"]

_DEST = "model_flag:"


@dataclass(frozen=True)
class ModelFlag:
    path: tuple[str, ...]
    """The field's place in the model: ``("routing", "prefill")``."""
    field: FieldInfo

    @property
    def name(self) -> str:
        return "--" + "-".join(self.path).replace("_", "-")

    @property
    def dest(self) -> str:
        return _DEST + ".".join(self.path)


def model_flags(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[ModelFlag]:
    """Every leaf field of ``model``, nested models walked into."""
    flags = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            flags += model_flags(annotation, (*prefix, name))
        else:
            flags.append(ModelFlag((*prefix, name), field))
    return flags


def add_model_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: type[BaseModel],
) -> list[ModelFlag]:
    """A flag for each setting of ``model``."""
    flags = model_flags(model)
    for flag in flags:
        parser.add_argument(flag.name, dest=flag.dest, default=argparse.SUPPRESS, **_argument(flag))
    return flags


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The model fields the command line set, as a nested mapping (``{"routing": {"prefill": ...}}``)."""
    values: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if dest.startswith(_DEST):
            *parents, leaf = dest.removeprefix(_DEST).split(".")
            node = values
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
    return values


def overlay(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``top``'s values laid over it, nested mappings merged."""
    merged = dict(base)
    for key, value in top.items():
        below = merged.get(key)
        merged[key] = overlay(below, value) if isinstance(below, dict) and isinstance(value, dict) else value
    return merged


def _argument(flag: ModelFlag) -> dict[str, Any]:
    field = flag.field
    annotation = _without_none(field.annotation)
    help_text = (field.description or "").replace("%", "%%")
    default = field.get_default(call_default_factory=True)
    if default not in (None, (), [], ""):
        help_text += f" (default: {_shown(default)})"
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction, "help": help_text}
    origin = typing.get_origin(annotation)
    if origin in (tuple, list):
        item = typing.get_args(annotation)[0]
        return {
            "action": "append",
            "type": _checker(item, flag),
            "metavar": "VALUE",
            "help": help_text + " (repeatable)",
        }
    if origin is typing.Literal:
        return {"choices": typing.get_args(annotation), "help": help_text}
    checked = typing.Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation
    return {"type": _checker(checked, flag), "metavar": _metavar(flag, annotation), "help": help_text}


def _metavar(flag: ModelFlag, annotation: Any) -> str:
    name = flag.path[-1]
    for suffix, metavar in (("_s", "SECONDS"), ("_file", "PATH"), ("_env", "NAME"), ("_networks", "CIDR")):
        if name.endswith(suffix):
            return metavar
    return {int: "N", float: "X"}.get(annotation, name.upper())


def _without_none(annotation: Any) -> Any:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        rest = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _checker(annotation: Any, flag: ModelFlag):
    adapter = TypeAdapter(annotation)

    def check(text: str) -> Any:
        try:
            return adapter.validate_python(text)
        except ValidationError as e:
            error = e.errors()[0]
            shown = "" if (error.get("ctx") or {}).get("hide_input") else f" (got {text!r})"
            raise argparse.ArgumentTypeError(error["msg"] + shown) from None

    check.__name__ = flag.name  # argparse names it in "invalid ... value"
    return check


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
