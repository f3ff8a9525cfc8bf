"""Loading a job config: defaults < TOML file (``--job.config_file``) < command line, and ``--help``.

Overrides are ``--section.key value``, ``--section.key=value``, ``--section.flag`` /
``--section.no-flag`` for booleans, lists comma-separated. A bad option or value raises
:class:`~torchtitan_lite.errors.ConfigError` with one line naming the key, the value and what is
allowed.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtitan_lite.config import torchtitan
from torchtitan_lite.config.schema import (
    SECTIONS,
    Float8,
    JobConfig,
    allowed_values,
    coerce,
    field_docs,
    field_types,
    is_optional,
    type_name,
    unrelated,
    validate_config,
)
from torchtitan_lite.config.torchtitan import TORCHTITAN_KEYS, TorchTitanKey
from torchtitan_lite.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["closest_name", "format_help", "load_job_config"]


def _edit_distance(a: str, b: str) -> int:
    """Optimal-string-alignment distance: insertions, deletions, substitutions and swaps of two
    neighbouring characters each cost 1."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def closest_name(name: str, choices: list[str]) -> str | None:
    """The one choice a typo of ``name`` most likely meant: at most 1 edit in names up to 11
    characters, 2 up to 17, 3 beyond; None when there is no such choice or two tie."""
    limit = 1 if len(name) <= 11 else 2 if len(name) <= 17 else 3
    scored = sorted((_edit_distance(name, c), c) for c in choices if c != name)
    if not scored or scored[0][0] > limit or (len(scored) > 1 and scored[1][0] == scored[0][0]):
        return None
    return scored[0][1]


def _sections() -> list[str]:
    """Our sections, then the sections only TorchTitan's keys have (e.g. ``experimental``)."""
    extra = [k.name.split(".")[0] for k in TORCHTITAN_KEYS]
    return list(dict.fromkeys([*SECTIONS, *extra]))


def _keys_of(section: str) -> list[str]:
    """Every dotted key under ``section``: ours, then TorchTitan's."""
    ours = [f"{section}.{k}" for k in field_types(SECTIONS[section])] if section in SECTIONS else []
    theirs = [k.name for k in TORCHTITAN_KEYS if k.name.split(".")[0] == section]
    return [*ours, *theirs]


def _setting(name: str) -> str:
    """Our key for a renamed key of TorchTitan's; any other key itself."""
    entry = torchtitan.lookup(name)
    return entry.target if entry is not None and entry.target is not None else name


def _hint(name: str) -> str:
    """``; did you mean '...'?`` only when the suggestion is the same setting: a spelling within a
    few edits of a key of its own section, else the one setting of that name that TorchTitan moved
    between sections (``training.seed`` → ``debug.seed``); nothing when there are two."""
    section, _, key = name.partition(".")
    if section in _sections():
        close = closest_name(key, [k.split(".", 1)[1] for k in _keys_of(section)])
        if close is not None:
            return f"; did you mean '{section}.{close}'?"
    last = name.rsplit(".", 1)[-1]
    every = [k for s in _sections() for k in _keys_of(s)]
    named = [k for k in every if k.rsplit(".", 1)[-1] == last and k != name]
    moved = len({k.split(".")[0] for k in named}) > 1  # the name stood in several sections
    settings = {_setting(k) for k in named}
    if moved and len(settings) == 1:
        return f"; did you mean '{settings.pop()}'?"
    if section in _sections():
        return ""
    close_section = closest_name(section, _sections())
    if close_section is not None:
        candidate = f"{close_section}.{key}"
        if candidate in _keys_of(close_section):
            return f"; did you mean '{candidate}'?"
        return f"; did you mean [{close_section}]?"
    return ""


def _field(name: str, *, where: str) -> tuple[Any, TorchTitanKey | None]:
    """The type of dotted key ``name`` and, for a key of TorchTitan's, its table entry; an unknown
    key or section raises :class:`ConfigError` (with a hint only where it is the same setting)."""
    section, _, key = name.partition(".")
    if section in SECTIONS and key in field_types(SECTIONS[section]):
        return field_types(SECTIONS[section])[key], None
    entry = torchtitan.lookup(name)
    if entry is not None:
        return entry.type, entry
    if section not in _sections():
        raise ConfigError(f"unknown section [{section}] in {where}{_hint(name)} (sections: {', '.join(SECTIONS)})")
    listed = (
        ", ".join(field_types(SECTIONS[section])) if section in SECTIONS else "see docs/migrating_from_torchtitan.md"
    )
    raise ConfigError(f"unknown key '{name}' in {where}{_hint(name)} (keys of [{section}]: {listed})")


@dataclass
class _Layer:
    """The values one source (the TOML file, or the command line) gives, by our key."""

    where: str
    values: dict[str, tuple[str, Any]] = field(default_factory=dict)  # our key -> (name as given, value)
    hf_assets: str | None = None  # TorchTitan's model.hf_assets_path, as given
    refused: list[str] = field(default_factory=list)  # the names whose value (or name) was refused
    incomplete: bool = False  # the file or one of its sections was not read: values are missing

    def read(self, name: str, raw: Any, *, from_cli: bool, errors: list[str], notes: list[str]) -> None:
        """Check ``name = raw`` and record what it sets; problems go to ``errors`` (and the name to
        :attr:`refused`)."""
        try:
            tp, entry = _field(name, where=self.where)
            if entry is not None and entry.kind == "off" and entry.neutral is torchtitan.ANY:
                notes.append(f"'{name}' (TorchTitan) has no effect here: {entry.remark}")
                return  # accepted whatever its value: it changes nothing here
            # A list's items too (a TOML list, or the command line's comma list).
            items = raw if isinstance(raw, list) else raw.split(",") if from_cli and isinstance(raw, str) else [raw]
            lacking = [x.strip() for x in items
                       if entry is None and isinstance(x, str) and (name, x.strip()) in torchtitan.LACKING_VALUES]
            if lacking:
                raise ConfigError(f"{name} = {raw!r} asks for {torchtitan.LACKING_VALUES[(name, lacking[0])]}, "
                                  f"which torchtitan_lite does not have; expected {allowed_values(tp)}")
            if entry is None and isinstance(raw, str) and (name, raw) in torchtitan.VALUE_ALIASES:
                ours, differs = torchtitan.VALUE_ALIASES[(name, raw)]
                notes.append(f"{name} = {raw!r} is TorchTitan's spelling of {ours!r}; {differs}")
                raw = ours
            value = coerce(name, raw, tp, from_cli=from_cli)
            if entry is None:
                self._set(name, name, value)
                return
            translated = torchtitan.translate(entry, value)
            if translated is None:
                return
            target, value = translated
            section, key = target.split(".", 1)
            value = coerce(target, value, field_types(SECTIONS[section])[key], from_cli=False)
            differs = f"; {entry.differs}" if entry.differs else ""
            notes.append(f"'{name}' is TorchTitan's name ({', '.join(entry.eras)}) of '{target}'{differs}")
            if name == "model.hf_assets_path":
                self.hf_assets = value
            self._set(target, name, value)
        except ConfigError as exc:
            errors.append(str(exc))
            self.refused.append(name)

    def _set(self, target: str, name: str, value: Any) -> None:
        if target in self.values and self.values[target][0] != name and self.values[target][1] != value:
            # The same key twice: the last one wins; two names of one key must agree, but for
            # TorchTitan's tokenizer_path, which wins over its hf_assets_path as it does there.
            other, before = self.values[target]
            if {name, other} == {"model.tokenizer_path", "model.hf_assets_path"}:
                if name == "model.tokenizer_path":
                    self.values[target] = (name, value)
                return
            raise ConfigError(
                f"'{other}' = {before!r} and '{name}' = {value!r} in {self.where} both set '{target}'; keep one"
            )
        self.values[target] = (name, value)

    def apply(self, config: JobConfig) -> None:
        for target, (_, value) in self.values.items():
            section, key = target.split(".", 1)
            setattr(getattr(config, section), key, value)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _parse_cli(argv: list[str], errors: list[str]) -> list[tuple[str, str]]:
    """Return ``(dotted key, raw value)`` overrides in order; each problem (an unknown key, a flag
    misused, a missing value) goes to ``errors`` and parsing goes on."""
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            errors.append(f"unexpected argument {arg!r}; options look like --section.key value (see --help)")
            i += 1
            continue
        spelled, eq, inline = arg[2:].partition("=")
        section, _, key = spelled.partition(".")
        section = section.replace("-", "_")
        head, _, last = key.rpartition(".")
        prefix = f"{section}.{head}." if head else f"{section}."
        negated = False
        if last.startswith(("no-", "no_")):
            candidate = prefix + last[3:].replace("-", "_")
            try:
                _field(candidate, where="command line")
                negated, last = True, last[3:]
            except ConfigError:
                pass
        name = prefix + last.replace("-", "_")
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        takes_next = not eq and nxt is not None and not nxt.startswith("--")
        try:
            tp, _ = _field(name, where="command line")
        except ConfigError as exc:
            errors.append(str(exc))
            i += 2 if takes_next else 1  # its value too, if it has one
            continue
        is_bool = is_optional(tp)[1] is bool
        if negated:
            if not is_bool:
                errors.append(f"--{spelled}: '{name}' is not a boolean flag")
            elif eq:
                errors.append(f"--{spelled} takes no value")
            else:
                overrides.append((name, "false"))
            i += 1
            continue
        if eq:
            overrides.append((name, inline))
            i += 1
            continue
        if is_bool and not takes_next:
            overrides.append((name, "true"))
            i += 1
            continue
        if not takes_next:
            errors.append(f"--{name} expects a value ({allowed_values(tp)}); "
                          f"write --{name}=VALUE for a value that starts with --")
            i += 1
            continue
        overrides.append((name, nxt))
        i += 2
    return overrides


def format_help(prog: str = "python -m torchtitan_lite.train", *, notes: Mapping[str, str] | None = None) -> str:
    """Every option with its type, default and documentation; ``notes`` (``section.key`` → a
    line) adds what the caller knows and the schema cannot, such as the registered models."""
    notes = notes or {}
    defaults = JobConfig()
    lines = [
        f"usage: torchrun [torchrun options] -m torchtitan_lite.train --job.config_file FILE "
        f"[--section.key value ...]\n       {prog} [--section.key value ...]",
        "",
        "Settings load as: defaults < TOML file < command line. Booleans: --section.flag, "
        "--section.no-flag or an explicit true/false; lists are comma-separated.",
        "TorchTitan's TOML keys of its three TOML layouts are accepted as well (renamed ones with a note); "
        "docs/migrating_from_torchtitan.md lists them.",
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
            if f"{section}.{name}" in notes:
                lines.append(f"      {notes[f'{section}.{name}']}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_job_config(argv: list[str] | None = None, *, notes: list[str] | None = None) -> JobConfig:
    """Build a :class:`JobConfig` from defaults, a TOML file and ``argv`` overrides, checked by
    :func:`~torchtitan_lite.config.schema.validate_config` (the checks that need files, the
    world size or the model family follow in :mod:`torchtitan_lite.job`).

    TorchTitan's keys of its TOML era are read through :mod:`.torchtitan`'s table: a renamed key
    sets ours and adds a line to ``notes`` (when a list is given); a key of a feature we lack is
    accepted only with a value that asks for nothing.

    Every unknown section or key and every bad value of the file and the command line is
    reported at once, and so is every broken rule between values once those are fixed: one
    :class:`ConfigError` whose message has one line per problem."""
    argv = list(sys.argv[1:] if argv is None else argv)
    errors: list[str] = []
    notes = [] if notes is None else notes
    cli = _Layer("command line")
    for name, raw in _parse_cli(argv, errors):
        cli.read(name, raw, from_cli=True, errors=errors, notes=notes)
    config = JobConfig()
    config_file = cli.values.get("job.config_file", (None, None))[1]
    toml = _Layer("")
    if config_file:
        toml = _read_toml(Path(config_file), errors, notes)
    toml.apply(config)  # (the values that were fine: with errors, the rules between them are checked too)
    cli.apply(config)
    if config_file:
        config.job.config_file = str(config_file)
    given = {**toml.values, **cli.values}
    hf_assets = cli.hf_assets or toml.hf_assets
    if given.get("model.tokenizer_path", ("",))[0] == "model.tokenizer_path" and hf_assets is not None:
        notes.append("'model.tokenizer_path' is the tokenizer, not the one in 'model.hf_assets_path' "
                     "(as in TorchTitan)")
    ck = config.checkpoint
    if hf_assets is not None and ck.enable and ck.initial_load_in_hf and "checkpoint.initial_load_path" not in given:
        # TorchTitan's hf_assets_path also names the Hugging Face weights a checkpointed run starts from.
        ck.initial_load_path = hf_assets
        notes.append("'model.hf_assets_path' is also read as 'checkpoint.initial_load_path' "
                     "(checkpoint.enable and initial_load_in_hf are set, initial_load_path is not)")
    f8 = config.float8
    if not config.model.converters:
        changed = [f"float8.{k}" for k, v in dataclasses.asdict(f8).items()
                   if v != getattr(Float8(), k)]
        if changed:
            notes.append(f"{', '.join(changed)} {'has' if len(changed) == 1 else 'have'} no effect: "
                         "model.converters does not name float8")
    elif f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
        notes.append("float8.precompute_float8_dynamic_scale_for_fsdp has no effect without "
                     "float8.enable_fsdp_float8_all_gather")
    notes[:] = list(dict.fromkeys(notes))
    try:
        if not toml.incomplete:  # (values of the file are missing: the rules would judge defaults)
            validate_config(config, given=given)
    except ConfigError as exc:
        # A rule that names a key whose value was refused compared that key's default: left out.
        errors += unrelated(str(exc).splitlines(), [*toml.refused, *cli.refused])
    if errors:
        raise ConfigError("\n".join(dict.fromkeys(errors)))
    return config


def _is_table_key(name: str) -> bool:
    """Whether ``name`` is one of our keys whose value is a whole table (``training.chat_template_kwargs``)."""
    section, _, key = name.partition(".")
    tp = field_types(SECTIONS[section]).get(key) if section in SECTIONS else None
    return typing.get_origin(tp) is dict


def _flatten(table: dict[str, Any], prefix: str) -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of a TOML table; nested tables (``[quantize.linear.float8]``) give
    longer keys."""
    out: list[tuple[str, Any]] = []
    for key, value in table.items():
        if isinstance(value, dict) and not _is_table_key(f"{prefix}{key}"):
            out.extend(_flatten(value, f"{prefix}{key}."))
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _read_toml(path: Path, errors: list[str], notes: list[str]) -> _Layer:
    where = f"'{path}'"
    layer = _Layer(where)
    layer.incomplete = True  # (until the file is read)
    if not path.is_file():
        errors.append(f"job.config_file: file not found: {str(path)!r}")
        return layer
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        errors.append(f"job.config_file: {str(path)!r} is not valid TOML: {exc}")
        return layer
    layer.incomplete = False
    for section, values in data.items():
        if section not in _sections():
            errors.append(f"unknown section [{section}] in {where}{_hint(section + '.')} "
                          f"(sections: {', '.join(SECTIONS)})")
            layer.incomplete = True
            continue
        if not isinstance(values, dict):
            errors.append(f"{where}: '{section}' must be a [section] table, got {values!r}")
            continue
        for name, value in _flatten(values, f"{section}."):
            if name == "job.config_file":
                errors.append(f"job.config_file cannot be set inside a config file ({where}); "
                              "pass it on the command line")
                continue
            layer.read(name, value, from_cli=False, errors=errors, notes=notes)
    return layer
