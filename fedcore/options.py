"""Command-line options derived from config dataclasses: one declaration per setting.

A config field (name, type, default, and its ``Attributes:`` entry in the class docstring) is the only place a
setting is declared. :func:`derive_options` walks a config dataclass, nested sections included, and makes one
:class:`Option` per field; :func:`add_options` turns them into argparse flags and :func:`given_values` turns the
parsed flags back into a nested mapping with the same keys as the TOML file, so a new config field is one edit:
it is a TOML key and a flag at once.

How a field becomes a flag:

- the flag is ``--`` + the field's name with ``-`` for ``_`` (``round_timeout_s`` -> ``--round-timeout-s``),
  whatever section it is in, unless the caller pins another name for its key (``train.local_epochs`` ->
  ``--epochs``); two fields of the same name in different sections (or a name the command uses itself) get their
  section in front (``--train-momentum``), so adding a field never breaks a flag that exists;
- ``int``, ``float``, ``str``, ``Path`` (or these ``| None``): a value flag; a ``Literal``: a value flag with
  its choices;
- ``bool``: a switch that sets the opposite of the default (``--insecure`` for a default of False,
  ``--no-evaluate`` for a default of True);
- ``tuple[X, ...]``: repeatable (``--revoke ID --revoke ID2``); ``Mapping[str, str]``: repeatable ``KEY=VALUE``;
- a nested config dataclass: its fields, keyed ``section.field``;
- any other type (a plan object, a list of tables): no flag; it is set from the TOML file or ``--set``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import types
import typing
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fedcore.config import field_docs
from fedcore.errors import ConfigError

Action = Literal["store", "store_true", "store_false", "append", "pairs"]
_VALUE_TYPES = (int, float, str, Path)


@dataclass(frozen=True)
class Option:
    """One command-line option, derived from one config field.

    Attributes:
        key: the dotted config key it sets (``round.rounds``, ``train.local_epochs``), as in the TOML file.
        flag: the option string (``--rounds``).
        kind: the value's type (``int``, ``float``, ``str``, ``Path``; ``bool`` for switches; the item type of a
            repeatable option).
        action: ``store`` (one value), ``store_true``/``store_false`` (a switch), ``append`` (repeatable value),
            ``pairs`` (repeatable ``KEY=VALUE`` into a table).
        default: the field's default (shown in the help; the flag itself defaults to "not given").
        help: the field's description from its class docstring.
        choices: the allowed values of a ``Literal`` field, else None.
    """

    key: str
    flag: str
    kind: type
    action: Action
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None

    @property
    def dest(self) -> str:
        """The argparse destination (the key itself, so no two options share one)."""
        return "config:" + self.key


def _unwrap_optional(annotation: Any) -> Any:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else annotation
    return annotation


def _shape(annotation: Any) -> tuple[Action, type, tuple[Any, ...] | None] | None:
    """(action, kind, choices) for a field's annotation, or None when it has no flag."""
    annotation = _unwrap_optional(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is bool:
        return "store_true", bool, None
    if annotation in _VALUE_TYPES:
        return "store", annotation, None
    if origin is Literal and args and all(type(a) is type(args[0]) for a in args):
        return "store", type(args[0]), args
    if origin in (tuple, list, Sequence) and args and args[0] in _VALUE_TYPES and (len(args) == 1 or args[1] is ...):
        return "append", args[0], None
    if origin in (dict, Mapping) and args == (str, str):
        return "pairs", str, None
    return None


def _walk(
    cls: type, prefix: str, skip: Collection[str], defaults: object | None
) -> list[tuple[str, str, Any, Any, str]]:
    """(key, name, annotation, default, help) of every field, nested sections flattened. ``defaults`` is the
    section's default value (a section's default may differ from its class's field defaults), None at the root."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if not f.init or key in skip:
            continue
        if defaults is not None:
            default = getattr(defaults, f.name)
        elif f.default_factory is not dataclasses.MISSING:
            try:
                default = f.default_factory()
            except ConfigError:  # a section with no valid default (TLS needs files): its fields' own defaults
                default = None
        else:
            default = None if f.default is dataclasses.MISSING else f.default
        annotation = hints[f.name]
        if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
            out += _walk(annotation, key + ".", skip, default)
        else:
            out.append((key, f.name, annotation, default, plain_text(docs.get(f.name, ""))))
    return out


# a Sphinx cross-reference role, :mod:`a.b` (also :py:class:, ~ and "title <target>"); then an inline literal ``x``
_ROLE = re.compile(r":(?:\w+:)?\w+:`(~?)([^`<]*?)\s*(?:<([^`>]*)>)?`")
_LITERAL = re.compile(r"``(.+?)``")


def _role_text(match: re.Match[str]) -> str:
    tilde, title, target = match.groups()
    if target is not None and title:  # :class:`the pool <simulations.raypool.RayPool>`
        return title
    name = target if target is not None else title
    return name.rsplit(".", 1)[-1] if tilde else name  # ~a.b.C shows C, as Sphinx does


def plain_text(doc: str) -> str:
    """A field's docstring text as ``--help`` shows it: Sphinx markup stripped for a terminal.

    ``x`` becomes x; a role such as :mod:`a.b`, :class:`C`, :func:`f` or :py:meth:`C.m` becomes its target
    (a.b, C, f, C.m), :class:`~a.b.C` its last part (C), and :class:`title <a.b.C>` its title. Other text,
    single backticks included, is left as it is.
    """
    return _LITERAL.sub(r"\1", _ROLE.sub(_role_text, doc))


def derive_options(
    cls: type, *, flags: Mapping[str, str] | None = None, skip: Collection[str] = (), reserved: Collection[str] = ()
) -> tuple[Option, ...]:
    """One :class:`Option` per field of the config dataclass ``cls`` (nested sections included).

    Args:
        cls: the root config dataclass (e.g. ``ServerConfig``).
        flags: pinned flag names by key, without the dashes (``{"train.local_epochs": "epochs"}``); they keep
            existing flags stable.
        skip: keys that get no flag (the command handles them itself).
        reserved: flag names the command defines itself (``config``, ``set``); a field of that name gets its
            section in front.

    Raises:
        ConfigError: two pinned names are equal, two fields end up with the same flag, or a top-level field is
            named like a ``reserved`` flag (a bug in the caller's table, found when the parser is built).
    """
    pinned = dict(flags or {})
    fields = _walk(cls, "", skip, None)
    taken = set(pinned.values()) | {r.replace("_", "-") for r in reserved}
    if len(set(pinned.values())) != len(pinned):
        raise ConfigError(f"two config keys pin the same flag in {sorted(pinned.items())}")
    names = [name for key, name, *_ in fields if key not in pinned]
    options = []
    seen: dict[str, str] = {}
    for key, name, annotation, default, help_text in fields:
        shape = _shape(annotation)
        if shape is None:
            continue
        action, kind, choices = shape
        if key in pinned:
            flag = pinned[key]
        else:
            flag = name.replace("_", "-")
            if flag in taken or names.count(name) > 1:
                flag = key.replace(".", "-").replace("_", "-")
                if flag in taken:  # a top-level field named like one of the command's own flags
                    raise ConfigError(f"config key {key!r} wants the flag --{flag}, which the command uses; pin one")
            if action == "store_true" and default is True:
                flag = "no-" + flag
        if action == "store_true" and default is True:
            action = "store_false"
        if flag in seen:
            raise ConfigError(f"config keys {seen[flag]!r} and {key!r} both want the flag --{flag}; pin one")
        seen[flag] = key
        options.append(Option(key, "--" + flag, kind, action, default, help_text, choices))
    return tuple(options)


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    """Add the options to ``parser``, those of a nested table under its ``[table]`` heading in the help. Each
    defaults to None ("not given"), so a flag only overrides what the user typed."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for option in options:
        section, _, name = option.key.rpartition(".")
        target: argparse._ArgumentGroup | argparse.ArgumentParser = parser
        if section:
            if section not in groups:
                groups[section] = parser.add_argument_group(f"[{section}]")
            target = groups[section]
        text = option.help.replace("%", "%%")
        if option.default not in (None, (), {}) and option.action == "store":
            text = f"{text} (default: {option.default})".strip()
        elif option.action == "store_false" and option.flag.startswith("--no-"):  # --stay's own help says it
            text = f"turn off, which is on by default: {text}"
        kwargs: dict[str, Any] = {"dest": option.dest, "default": None, "help": text or None}
        if option.action in ("store_true", "store_false"):
            kwargs["action"] = "store_const"
            kwargs["const"] = option.action == "store_true"
        elif option.action == "pairs":
            kwargs.update(action="append", metavar="KEY=VALUE")
        else:
            kwargs["type"] = str if option.kind is Path else option.kind
            kwargs["metavar"] = name.upper()
            if option.action == "append":
                kwargs["action"] = "append"
            if option.choices is not None:
                kwargs["choices"] = option.choices
                del kwargs["metavar"]
        target.add_argument(option.flag, **kwargs)


def parse_pairs(items: Sequence[str], flag: str) -> dict[str, str]:
    """``["a=1", "b=x"]`` -> ``{"a": "1", "b": "x"}``.

    Raises:
        ConfigError: an item is not ``KEY=VALUE`` with a non-empty key.
    """
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{flag} {item!r} must look like KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def given_values(args: argparse.Namespace, options: Sequence[Option]) -> dict[str, Any]:
    """The flags the user gave, as a nested mapping keyed like the TOML file (``{"round": {"rounds": 3}}``).

    Raises:
        ConfigError: a ``KEY=VALUE`` option without ``=``.
    """
    out: dict[str, Any] = {}
    for option in options:
        value = getattr(args, option.dest, None)
        if value is None:
            continue
        if option.action == "pairs":
            value = parse_pairs(value, option.flag)
        node = out
        *sections, last = option.key.split(".")
        for section in sections:
            node = node.setdefault(section, {})
        node[last] = value
    return out


def toml_literal(value: Any) -> str:
    """``value`` written as a TOML value (for ``section.key=value`` overrides).

    Raises:
        ConfigError: a value of a type TOML cannot hold (a flag value is always one it can).
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value) if math.isfinite(value) else ("nan" if value != value else ("inf" if value > 0 else "-inf"))
    if isinstance(value, str | Path):
        return json.dumps(str(value))  # a JSON string is a TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    raise ConfigError(f"{value!r} ({type(value).__name__}) cannot be written as a TOML value")


def to_overrides(values: Mapping[str, Any], prefix: str = "") -> list[str]:
    """A nested mapping (as :func:`given_values` makes) as ``section.key=value`` overrides, one per leaf value."""
    out = []
    for key, value in values.items():
        if isinstance(value, Mapping):
            out += to_overrides(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={toml_literal(value)}")
    return out
