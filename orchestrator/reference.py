"""The configuration reference, written from the settings models (``pdserve schema``).

``json_schema(name)`` is the JSON schema of a settings file (editors validate
YAML with it); ``markdown(name)`` the reference page ``docs/configuration.md``
is generated from (a test keeps the page current). Both read only the models:
a field's type, default, bounds and description are said once, where it is
defined.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

__all__ = ["SCHEMAS", "json_schema", "markdown"]


def _models() -> dict[str, type[BaseModel]]:
    from orchestrator.spec import ClusterSpec
    from proxy.config import ProxySettings

    return {"cluster": ClusterSpec, "proxy": ProxySettings}


SCHEMAS = ("cluster", "proxy")
"""``cluster``: a cluster spec (``pdserve up``); ``proxy``: ``pdserve proxy --config`` (a spec's ``proxy``)."""

_TITLES = {"cluster": "Cluster spec (`pdserve up CONFIG`)", "proxy": "Standalone proxy (`pdserve proxy --config FILE`)"}


def json_schema(name: str) -> dict[str, Any]:
    model = _models()[name]
    schema = model.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema.setdefault("title", model.__name__)
    return schema


def markdown() -> str:
    """The reference page: each section of a cluster spec, a table of its keys."""
    models = _models()
    lines = [
        "# Configuration reference",
        "",
        "Generated from the settings models by `pdserve schema --markdown`; do not edit by hand.",
        "`pdserve schema cluster` and `pdserve schema proxy` print the JSON schemas (point your editor's YAML",
        "language server at them to check a spec as you type).",
        "",
        f"## {_TITLES['cluster']}",
        "",
    ]
    sections: list[tuple[str, type[BaseModel]]] = []
    lines += _table(models["cluster"], "", sections)
    for key, model in sections:
        lines += ["", f"### `{key}`", ""]
        if model.__doc__ and not model.__doc__.startswith(model.__name__ + "("):
            lines += [" ".join(model.__doc__.split()), ""]
        lines += _table(model, key + ".", sections)
    lines += [
        "",
        f"## {_TITLES['proxy']}",
        "",
        "The keys of a cluster spec's [`proxy`](#proxy) section but `placement`; each is also a flag:",
        "`routing.prefill` is `--routing-prefill`, `max_body_bytes` is `--max-body-bytes`",
        "(`pdserve proxy --help` lists them). Flags override the file.",
        "",
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


def _table(model: type[BaseModel], prefix: str, sections: list[tuple[str, type[BaseModel]]]) -> list[str]:
    rows = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        key = prefix + name
        nested = _nested_model(field.annotation)
        section = next((known for known, model in sections if model is nested), key)  # one table per model
        if nested is not None and all(section != known for known, _ in sections):
            sections.append((key, nested))
        described = field.description or ""
        if nested is not None:
            described = (described + f" See [`{section}`](#{section.replace('.', '')}).").strip()
        rows.append(f"| `{key}` | {_type_name(field.annotation)} | {_default(field)} | {_cell(described)} |")
    return rows


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The settings model a field holds (alone, optional, or in a list)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for candidate in typing.get_args(annotation):
        if (found := _nested_model(candidate)) is not None:
            return found
    return None


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if isinstance(annotation, types.UnionType) or origin is typing.Union:
        return " or ".join(_type_name(arg) for arg in typing.get_args(annotation))
    if origin is typing.Literal:
        return " \\| ".join(f"`{value}`" for value in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin in (list, tuple):
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    if origin is dict:
        key, value = typing.get_args(annotation)
        return f"map of {_type_name(key)} to {_type_name(value)}"
    if annotation is type(None):
        return "null"
    if annotation is typing.Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(see section)"
    if value is None:
        return ""
    return f"`{json.dumps(value, default=str)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
