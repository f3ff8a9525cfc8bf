"""Loading a job config: defaults < TOML file (``--job.config_file``) < command line, and ``--help``.

Overrides are ``--section.key value``, ``--section.key=value``, ``--section.flag`` /
``--section.no-flag`` for booleans, lists comma-separated. A bad option or value raises
:class:`~torchtitan_lite.errors.ConfigError` with one line naming the key, the value and what is
allowed.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Any

from torchtitan_lite.config.schema import (
    SECTIONS,
    JobConfig,
    allowed_values,
    coerce,
    field_docs,
    field_types,
    is_optional,
    type_name,
    validate_config,
)
from torchtitan_lite.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["format_help", "load_job_config"]


def _suggest(name: str, choices: list[str], *, prefix: str = "") -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f"; did you mean '{prefix}{close[0]}'?" if close else ""


def _lookup(section: str, key: str | None, *, where: str) -> tuple[type, Any]:
    if section not in SECTIONS:
        raise ConfigError(
            f"unknown section [{section}] in {where}{_suggest(section, list(SECTIONS))} "
            f"(sections: {', '.join(SECTIONS)})"
        )
    cls = SECTIONS[section]
    types_ = field_types(cls)
    if key is None:
        return cls, None
    if key not in types_:
        raise ConfigError(
            f"unknown key '{section}.{key}' in {where}{_suggest(key, list(types_), prefix=section + '.')} "
            f"(keys of [{section}]: {', '.join(types_)})"
        )
    return cls, types_[key]


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _parse_cli(argv: list[str], errors: list[str]) -> list[tuple[str, str, Any, str]]:
    """Return ``(section, key, field type, raw value)`` overrides in order; each problem (an
    unknown key, a flag misused, a missing value) goes to ``errors`` and parsing goes on."""
    overrides: list[tuple[str, str, Any, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            errors.append(f"unexpected argument {arg!r}; options look like --section.key value (see --help)")
            i += 1
            continue
        name, eq, inline = arg[2:].partition("=")
        section, _, key = name.partition(".")
        section = section.replace("-", "_")
        negated = False
        if key.startswith("no-") or key.startswith("no_"):
            candidate = key[3:].replace("-", "_")
            if section in SECTIONS and candidate in field_types(SECTIONS[section]):
                negated = True
                key = candidate
        key = key.replace("-", "_")
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        takes_next = not eq and nxt is not None and not nxt.startswith("--")
        try:
            _, tp = _lookup(section, key, where="command line")
        except ConfigError as exc:
            errors.append(str(exc))
            i += 2 if takes_next else 1  # its value too, if it has one
            continue
        is_bool = is_optional(tp)[1] is bool
        if negated:
            if not is_bool:
                errors.append(f"--{section}.no-{key}: '{section}.{key}' is not a boolean flag")
            elif eq:
                errors.append(f"--{section}.no-{key} takes no value")
            else:
                overrides.append((section, key, tp, "false"))
            i += 1
            continue
        if eq:
            overrides.append((section, key, tp, inline))
            i += 1
            continue
        if is_bool and not takes_next:
            overrides.append((section, key, tp, "true"))
            i += 1
            continue
        if not takes_next:
            errors.append(f"--{section}.{key} expects a value ({allowed_values(tp)}); "
                          f"write --{section}.{key}=VALUE for a value that starts with --")
            i += 1
            continue
        overrides.append((section, key, tp, nxt))  # type: ignore[arg-type]
        i += 2
    return overrides


def format_help(prog: str = "python -m torchtitan_lite.train") -> str:
    """Every option with its type, default and documentation."""
    defaults = JobConfig()
    lines = [
        f"usage: torchrun [torchrun options] -m torchtitan_lite.train --job.config_file FILE "
        f"[--section.key value ...]\n       {prog} [--section.key value ...]",
        "",
        "Settings load as: defaults < TOML file < command line. Booleans: --section.flag, "
        "--section.no-flag or an explicit true/false; lists are comma-separated.",
    ]
    for section, cls in SECTIONS.items():
        lines.append("")
        lines.append(f"[{section}]")
        docs = field_docs(cls)
        for name, tp in field_types(cls).items():
            default = getattr(getattr(defaults, section), name)
            lines.append(f"  --{section}.{name} {type_name(tp)}  (default: {default!r})")
            if name in docs:
                lines.append(f"      {docs[name]}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_job_config(argv: list[str] | None = None) -> JobConfig:
    """Build a :class:`JobConfig` from defaults, a TOML file and ``argv`` overrides, checked by
    :func:`~torchtitan_lite.config.schema.validate_config` (the checks that need files, the
    world size or the model family follow in :mod:`torchtitan_lite.job`).

    Every unknown section or key and every bad value of the file and the command line is
    reported at once: one :class:`ConfigError` whose message has one line per problem. The
    checks of combinations (:func:`validate_config`) run once those are all fixed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    errors: list[str] = []
    overrides = _parse_cli(argv, errors)
    config = JobConfig()

    values = []
    for section, key, tp, raw in overrides:
        try:
            values.append((section, key, coerce(f"{section}.{key}", raw, tp, from_cli=True)))
        except ConfigError as exc:
            errors.append(str(exc))
    config_file = next(
        (v for section, key, v in reversed(values) if (section, key) == ("job", "config_file")),
        None,
    )
    if config_file:
        _apply_toml(config, Path(config_file), errors)
    if errors:
        raise ConfigError("\n".join(dict.fromkeys(errors)))
    for section, key, value in values:
        setattr(getattr(config, section), key, value)
    validate_config(config)
    return config


def _apply_toml(config: JobConfig, path: Path, errors: list[str]) -> None:
    if not path.is_file():
        errors.append(f"job.config_file: file not found: {str(path)!r}")
        return
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        errors.append(f"job.config_file: {str(path)!r} is not valid TOML: {exc}")
        return
    where = f"'{path}'"
    for section, values in data.items():
        try:
            _lookup(section, None, where=where)
        except ConfigError as exc:
            errors.append(str(exc))
            continue
        if not isinstance(values, dict):
            errors.append(f"{where}: '{section}' must be a [section] table, got {values!r}")
            continue
        for key, value in values.items():
            try:
                _, tp = _lookup(section, key, where=where)
                if (section, key) == ("job", "config_file"):
                    raise ConfigError(
                        f"job.config_file cannot be set inside a config file ({where}); "
                        "pass it on the command line"
                    )
                setattr(getattr(config, section), key, coerce(f"{section}.{key}", value, tp, from_cli=False))
            except ConfigError as exc:
                errors.append(str(exc))
    config.job.config_file = str(path)
