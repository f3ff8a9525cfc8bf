"""What the schema's field types mean for a value: the types and documentation of a section's
fields, the values a type allows, and the conversion of a TOML value or a command-line string to
it (:func:`coerce`)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import sys
import types
import typing
from typing import Any, Literal

from torchtitan_lite.config.sections import JobConfig
from torchtitan_lite.errors import ConfigError

__all__ = ["SECTIONS", "allowed_values", "coerce", "field_docs", "field_types", "is_optional", "type_name"]


# --------------------------------------------------------------------------------------------
# Introspection helpers
# --------------------------------------------------------------------------------------------

SECTIONS: dict[str, type] = {
    f.name: f.default_factory
    for f in dataclasses.fields(JobConfig)
}


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under dataclass fields (read from the source)."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def is_optional(tp: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            if len(args) != 1:
                raise TypeError(f"unsupported optional union {tp}")
            return True, args[0]
    return False, tp


def type_name(tp: Any) -> str:
    optional, inner = is_optional(tp)
    if optional:
        return f"{type_name(inner)} | None"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(tp)) + "}"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    if origin is dict:
        return "table"
    return getattr(tp, "__name__", str(tp))


def allowed_values(tp: Any) -> str:
    origin = typing.get_origin(is_optional(tp)[1])
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(is_optional(tp)[1]))
    return f"a value of type {type_name(tp)}"


def _bracketed(text: str) -> list[Any]:
    """A command line's ``[a, b]``: a TOML array (``[1.0, 0.1]``, ``["a", "b"]``), or, when it is
    not one (``[a, b]``, unquoted words), its items between the commas."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on Python 3.10 only
        import tomli as tomllib
    try:
        return list(tomllib.loads(f"v = {text}")["v"])
    except tomllib.TOMLDecodeError:
        return [v.strip().strip("'\"") for v in text[1:-1].split(",") if v.strip()]


def coerce(key: str, value: Any, tp: Any, *, from_cli: bool) -> Any:
    """Convert ``value`` (a TOML value, or a string from the command line) to ``tp``."""
    optional, inner = is_optional(tp)
    if optional:
        if value is None or (from_cli and str(value).lower() in ("none", "null")):
            return None
        return coerce(key, value, inner, from_cli=from_cli)
    origin = typing.get_origin(inner)
    bad = ConfigError(f"{key}: invalid value {value!r}; expected {allowed_values(tp)}")
    if origin is Literal:
        allowed = typing.get_args(inner)
        if value in allowed:
            return value
        raise bad
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(inner):
            try:
                return coerce(key, value, option, from_cli=from_cli)
            except ConfigError:
                continue
        raise bad
    if origin is list and dataclasses.is_dataclass(typing.get_args(inner)[0]):
        return _coerce_tables(key, value, typing.get_args(inner)[0], from_cli=from_cli)
    if origin is list:
        (elem,) = typing.get_args(inner)
        if isinstance(value, str) and from_cli and value.strip()[:1] == "[" and value.strip()[-1:] == "]":
            items: list[Any] = _bracketed(value.strip())  # [1.0, 0.1] as a TOML file writes it
        elif isinstance(value, str):  # a comma list (TorchTitan's TOML files write some lists so)
            items = [v.strip() for v in value.split(",") if v.strip()]
        elif isinstance(value, list):
            items = value
        else:
            raise bad
        converted = []
        for item in items:
            try:
                converted.append(coerce(key, item, elem, from_cli=from_cli))
            except ConfigError as exc:
                if not (from_cli and isinstance(item, str) and any(c in item for c in " ;[]")):
                    raise
                # (another list syntax: items apart by spaces or semicolons, a bracket left over)
                raise ConfigError(f"{exc} in each item of the list {value!r} (items between commas, or [a, b] as "
                                  "in a TOML file)") from None
        return converted
    if inner is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str):
            lowered = value.lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
        raise ConfigError(f"{key}: invalid value {value!r}; expected true or false")
    if inner in (int, float):
        # TOML ints are valid floats, never the other way round; bools are not numbers.
        accepted = (int, float) if inner is float else int
        if isinstance(value, accepted) and not isinstance(value, bool):
            return inner(value)
        if from_cli and isinstance(value, str):
            try:
                return inner(value)
            except ValueError:
                pass
        what = "an integer" if inner is int else "a number"
        raise ConfigError(f"{key}: invalid value {value!r}; expected {what}")
    if inner is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: invalid value {value!r}; expected a string")
    if origin is dict:
        if from_cli and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                pass
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return dict(value)
        raise ConfigError(f"{key}: invalid value {value!r}; expected a table (in TOML) or a JSON object "
                          "(on the command line)")
    raise ConfigError(f"{key}: unsupported field type {type_name(tp)}")  # pragma: no cover


def _coerce_tables(key: str, value: Any, cls: Any, *, from_cli: bool) -> list[Any]:
    """A TOML array of tables (``[[training.datasets]]``) as a list of ``cls``; each key checked."""
    if from_cli:
        raise ConfigError(f"{key}: cannot be set on the command line; write [[{key}]] tables in the TOML file")
    if not isinstance(value, list):
        raise ConfigError(f"{key}: invalid value {value!r}; expected [[{key}]] tables")
    types_ = field_types(cls)
    out = []
    for i, item in enumerate(value):
        table = dataclasses.asdict(item) if dataclasses.is_dataclass(item) else item
        if not isinstance(table, dict):
            raise ConfigError(f"{key}: invalid entry {item!r}; expected a table with {', '.join(types_)}")
        where = f"{key}[{table['name']}]" if isinstance(table.get("name"), str) and table["name"] else f"{key}[{i}]"
        unknown = sorted(set(table) - set(types_))
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r} (keys: {', '.join(types_)})")
        out.append(cls(**{name: coerce(f"{where}.{name}", v, types_[name], from_cli=False)
                          for name, v in table.items()}))
    return out
