"""Config loading: frozen dataclasses built from TOML tables and ``section.key=value`` overrides.

Each component owns a frozen, keyword-only config dataclass that validates itself in ``__post_init__``; a recipe
is a root dataclass whose fields are those configs. This module only moves values into them:
:func:`from_mapping` builds a dataclass from a (nested) mapping, rejecting unknown keys and wrongly typed values;
:func:`load_toml` reads a file; :func:`apply_overrides` applies CLI overrides without mutating anything.
All errors are :class:`~fedcore.errors.ConfigError` raised before a run starts.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from fedcore.errors import ConfigError

T = TypeVar("T")


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as exc:
                errors.append(exc.message)
        raise ConfigError(f"{where}: {value!r} matches none of {annotation}: {'; '.join(errors)}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(repr(a) for a in args)}")
        return value
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        if isinstance(value, annotation):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        return from_mapping(annotation, value, where=where)
    if origin in (tuple, list, Sequence):
        if isinstance(value, str) or not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return tuple(_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        return {str(k): _coerce(v, args[1] if args else Any, f"{where}.{k}") for k, v in value.items()}
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if annotation is Path:
        if not isinstance(value, str | Path):
            raise ConfigError(f"{where}: expected a path, got {value!r}")
        return Path(value)
    return value


def from_mapping(cls: type[T], data: Mapping[str, Any], *, where: str = "") -> T:
    """Build the dataclass ``cls`` from ``data`` (nested tables become nested dataclasses).

    Raises:
        ConfigError: an unknown key (with the known ones listed), a value of the wrong type, or whatever the
            dataclass's own validation raises.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(repr(k) for k in unknown)} in [{where or 'top level'}]; "
            f"known keys: {', '.join(sorted(fields))}"
        )
    kwargs = {name: _coerce(value, hints[name], f"{where}.{name}" if where else name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"[{where or 'top level'}] {exc.message}") from None
    except TypeError as exc:
        raise ConfigError(f"[{where or 'top level'}] {exc}") from None


def to_mapping(config: object) -> dict[str, Any]:
    """The nested plain-dict form of a config dataclass (for saving next to a run's results)."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"{config!r} is not a dataclass instance")

    def plain(value: Any) -> Any:
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, tuple):
            return [plain(v) for v in value]
        return value

    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out[f.name] = to_mapping(value)
        elif value is not None:
            out[f.name] = plain(value)
    return out


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file into a dict.

    Raises:
        ConfigError: the file is missing or not valid TOML (with the parser's line and column).
    """
    p = Path(path)
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(p)!r} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(p)!r}: {exc.strerror or exc}") from None


def _parse_scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a deep copy of ``data`` with ``section.key=value`` overrides applied.

    Values are parsed as TOML scalars (``0.1``, ``true``, ``"x"``, ``[1, 2]``), falling back to the raw string.

    Raises:
        ConfigError: an override is not of the form ``key=value``.
    """

    def copy(value: Any) -> Any:
        return {k: copy(v) for k, v in value.items()} if isinstance(value, Mapping) else value

    result: dict[str, Any] = copy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.lr=0.05)")
        parts = key.split(".")
        node = result
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a table")
            node = child
        node[parts[-1]] = _parse_scalar(raw.strip())
    return result
