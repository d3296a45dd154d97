"""Config loading: frozen dataclasses built from TOML tables and ``section.key=value`` overrides.

Each component owns a frozen, keyword-only config dataclass that validates itself in ``__post_init__``; a recipe
is a root dataclass whose fields are those configs. This module only moves values into them:
:func:`from_mapping` builds a dataclass from a (nested) mapping, rejecting unknown keys and wrongly typed values;
:func:`load_toml` reads a file; :func:`apply_overrides` applies CLI overrides without mutating anything;
:func:`parse_address` is the one parser of every ``host:port`` a user gives (``[::1]:8443`` for IPv6).
All errors are :class:`~fedcore.errors.ConfigError` raised before a run starts.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import stat
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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
            raise ConfigError(f"{where}: expected a string, got {value!r}{_quote_hint(value, where)}")
        return value
    if annotation is Path:
        if not isinstance(value, str | Path):
            raise ConfigError(f"{where}: expected a path, got {value!r}{_quote_hint(value, where)}")
        return expand_home(value, where)
    return value


def expand_home(value: str | os.PathLike[str], where: str) -> Path:
    """``value`` as a path whose leading ``~`` (or ``~user``) is that home directory, as a shell reads it: a value
    given after ``=`` (``--out=~/runs``, ``--recipe=~/r.toml``) or in a file is not expanded by the shell, and
    would otherwise name a directory called ``~`` here.

    Raises:
        ConfigError: ``~user`` names no user (``where``: the setting, for the message).
    """
    try:
        return Path(value).expanduser()
    except RuntimeError:  # pathlib's "Could not determine home directory" (~nosuchuser/runs)
        raise ConfigError(f"{where}: {str(value)!r} names a home directory that does not exist") from None


def _quote_hint(value: Any, where: str) -> str:
    """How to give ``value`` as a string when it was read as a number or a boolean (``--set output.dir=2024`` is the
    integer 2024, as TOML reads it), or ``""`` for another value."""
    if not isinstance(value, bool | int | float):
        return ""
    return f" (a value that reads as a number or true/false is a string only in quotes: --set \"{where}='...'\")"


def from_mapping(cls: type[T], data: Mapping[str, Any], *, where: str = "", base: T | None = None) -> T:
    """Build the dataclass ``cls`` from ``data`` (nested tables become nested dataclasses).

    A table changes only the keys it gives: the others keep the values of ``base`` when given, else of the field's
    default (so a table given for a field whose default is not the class's own, such as ``fedcore simulate``'s
    FedAvgM strategy or a server's ``fraction_fit = 1.0``, changes those keys of that default and keeps the rest).
    A class that names a kind field (``CONFIG_KIND``, e.g. :class:`fedcore.strategy.StrategyConfig`'s ``name``)
    starts from its own class defaults when a table gives another kind than the base's: the base's settings of
    one strategy are not carried into another.

    Raises:
        ConfigError: an unknown key (with the known ones listed), a value of the wrong type, or whatever the
            dataclass's own validation raises.
    """
    if not dataclasses.is_dataclass(cls):
        raise ConfigError(f"{cls!r} is not a config dataclass; from_mapping builds dataclasses only")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(repr(k) for k in unknown)} in [{where or 'top level'}]; "
            f"known keys: {', '.join(sorted(fields))}" + _homes(unknown, fields, hints, where)
        )
    kind = getattr(cls, "CONFIG_KIND", None)
    if base is not None and isinstance(kind, str) and kind in data and data[kind] != getattr(base, kind):
        base = None  # another kind: from the class's own defaults
    kwargs: dict[str, Any] = {} if base is None else {name: getattr(base, name) for name in fields}
    for name, value in data.items():
        here = f"{where}.{name}" if where else name
        table_base = getattr(base, name) if base is not None else _default_value(fields[name])
        if isinstance(value, Mapping) and dataclasses.is_dataclass(table_base) and not isinstance(table_base, type):
            kwargs[name] = from_mapping(type(table_base), value, where=here, base=table_base)
        else:
            kwargs[name] = _coerce(value, hints[name], here)
    try:
        return cls(**kwargs)
    except ConfigError as exc:  # the root's own checks name their keys (a cross-table one: sampling.x, data.y)
        raise ConfigError(f"[{where}] {exc.message}" if where else exc.message) from None
    except TypeError as exc:
        raise ConfigError(f"[{where or 'top level'}] {exc}") from None


def _default_value(field: dataclasses.Field[Any]) -> Any:
    """The default of a dataclass field when it is not its type's own defaults: the value its default factory
    makes (``lambda: SamplingConfig(fraction_fit=1.0)``) or its default value; None for a field without one, or
    whose factory is a class (its defaults are what a table starts from anyway; not built, since a class such as
    the TLS settings may refuse its own defaults until a table fills them in)."""
    if field.default_factory is not dataclasses.MISSING:
        return None if isinstance(field.default_factory, type) else field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


def _homes(keys: list[str], fields: Mapping[str, dataclasses.Field[Any]], hints: Mapping[str, Any], where: str) -> str:
    """Where unknown ``keys`` of a table belong when one of its own tables has them (``backend`` written at the top
    level of a recipe is ``[simulation] backend``): ``"; 'backend' belongs in [simulation]"``, or ``""``."""
    homes: dict[str, list[str]] = {}
    for name in fields:
        table = hints[name]
        if dataclasses.is_dataclass(table) and isinstance(table, type):
            for sub in dataclasses.fields(table):
                homes.setdefault(sub.name, []).append(f"{where}.{name}" if where else name)
    found = [f"{key!r} belongs in [{'] or ['.join(homes[key])}]" for key in keys if key in homes]
    return "; " + "; ".join(found) if found else ""


def to_mapping(config: object) -> dict[str, Any]:
    """The nested plain-dict form of a config dataclass (for saving next to a run's results)."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise ConfigError(f"{type(config).__name__} is not a config dataclass instance; to_mapping reads those only")

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


@dataclass(frozen=True)
class ScalarField:
    """One scalar field of a config dataclass, as the conversions derived from the dataclass see it.

    Attributes:
        name: the field's name.
        kind: its value type: ``int``, ``float``, ``bool`` or ``str``.
        optional: whether ``None`` is allowed (declared ``kind | None``).
        default: the default value (``dataclasses.MISSING`` when the field is required).
        help: the field's description from the class docstring's ``Attributes:`` section ("" if none).
    """

    name: str
    kind: type
    optional: bool
    default: Any
    help: str


_SCALARS = (bool, int, float, str)


def scalar_fields(cls: type) -> tuple[ScalarField, ...]:
    """The fields of the dataclass ``cls`` in declaration order, each with its scalar type, default and help.

    The one place where the conversions of a flat settings class (``FitConfig`` to protobuf, to Flower's config
    dict, to command-line flags) learn its fields, so that a new field is one edit of the dataclass.

    Raises:
        ConfigError: ``cls`` is not a dataclass, or a field is not ``int``, ``float``, ``bool``, ``str`` or one of
            these ``| None`` (such a field cannot travel as one scalar: declare it so or convert it by hand).
    """
    known = _SCALAR_FIELDS.get(cls)
    if known is None:
        known = _SCALAR_FIELDS[cls] = _derive_scalar_fields(cls)  # a class's fields do not change: read them once
    return known


_SCALAR_FIELDS: dict[type, tuple[ScalarField, ...]] = {}


def _derive_scalar_fields(cls: type) -> tuple[ScalarField, ...]:
    if not dataclasses.is_dataclass(cls):
        raise ConfigError(f"{cls!r} is not a dataclass, so its fields cannot be derived")
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        annotation = hints[f.name]
        args = typing.get_args(annotation)
        optional = typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args
        kinds = [a for a in args if a is not type(None)] if optional else [annotation]
        if len(kinds) != 1 or kinds[0] not in _SCALARS:
            raise ConfigError(
                f"{cls.__name__}.{f.name} is declared {annotation}; a derived field must be int, float, bool, str "
                "or one of these | None"
            )
        default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        out.append(ScalarField(f.name, kinds[0], optional, default, docs.get(f.name, "")))
    return tuple(out)


_DOC_ENTRY = re.compile(r"^(\s*)([A-Za-z_][A-Za-z0-9_]*(?:\s*,\s*[A-Za-z_][A-Za-z0-9_]*)*):\s*(.*)$")


def field_docs(cls: type) -> dict[str, str]:
    """Each field's description from the Google-style ``Attributes:`` section of ``cls``'s docstring.

    An entry is ``name: text`` (continuation lines indented deeper); ``a, b: text`` describes both ``a`` and
    ``b``. Base classes' entries are included (a subclass's own entry wins). Returns ``{name: text}`` with the text
    on one line; a field without an entry is absent.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        lines = (klass.__doc__ or "").splitlines()
        try:
            start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
        except StopIteration:
            continue
        names: list[str] = []
        indent: int | None = None
        for line in lines[start + 1 :]:
            if not line.strip():
                continue
            match = _DOC_ENTRY.match(line)
            depth = len(line) - len(line.lstrip())
            if indent is None:
                indent = depth
            if depth < indent:
                break
            if depth == indent and match:
                names = [n.strip() for n in match.group(2).split(",")]
                for name in names:
                    docs[name] = match.group(3).strip()
            elif depth > indent:
                for name in names:
                    docs[name] = f"{docs[name]} {line.strip()}".strip()
            else:
                break
    return docs


def check_regular_file(path: Path, what: str, expected: str) -> None:
    """Refuse ``path`` when it exists and is neither a regular file nor a directory (which opening reports itself):
    a device such as /dev/zero is read without end, and opening a FIFO waits for a writer, so a recipe or a data file
    given as one would hang the run instead of failing it.

    Raises:
        ConfigError: ``path`` is such a file (``what`` names the setting, ``expected`` what to give instead).
        OSError: ``path`` cannot be examined (the caller reports it with its own words).
    """
    if path.exists() and not path.is_dir() and not stat.S_ISREG(path.stat().st_mode):
        raise ConfigError(f"{what} {str(path)!r} is not a regular file; give the path of {expected}")


MAX_TOML_BYTES = 16 << 20
"""The largest recipe or config file :func:`load_toml` reads."""


def load_toml(path: str | Path, *, json_record: bool = False) -> dict[str, Any]:
    """Read a TOML file (UTF-8; a byte-order mark, as some Windows editors write, is skipped) into a dict.

    Args:
        json_record: read a file named ``*.json`` as a JSON object instead (the ``config.json`` a simulation
            writes is its recipe, and ``fedcore simulate --recipe out/config.json`` runs it again).

    Raises:
        ConfigError: the file is missing, not a regular file (a directory, a device such as /dev/zero, a pipe:
            nothing a recipe is kept in), larger than :data:`MAX_TOML_BYTES`, or not valid TOML (with the parser's
            line and column), or with ``json_record`` not a JSON object; ``~user/...`` naming no user.
    """
    p = expand_home(path, "config file")  # --recipe=~/r.toml: no shell expands a '~' after '='
    try:
        check_regular_file(p, "config file", "a .toml file")
        with p.open("rb") as fh:
            data = fh.read(MAX_TOML_BYTES + 1)
        if len(data) > MAX_TOML_BYTES:
            raise ConfigError(f"config file {str(p)!r} is over {MAX_TOML_BYTES >> 20} MiB: not a recipe")
        text = data.decode("utf-8-sig")
        if json_record and p.suffix.lower() == ".json":
            return _json_object(text, p)
        return tomllib.loads(text)
    except IsADirectoryError:
        raise ConfigError(f"config file {str(p)!r} is a directory; give the path of a .toml file") from None
    except FileNotFoundError:
        raise ConfigError(f"config file {str(p)!r} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(p)!r}: {exc.strerror or exc}") from None


def _json_object(text: str, path: Path) -> dict[str, Any]:
    """The JSON object ``text`` holds (a recipe saved as JSON), with the file ``path`` named in the refusal.

    Raises:
        ConfigError: not valid JSON, or not an object (a list or a number is no recipe).
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"config file {str(path)!r} holds a JSON {type(value).__name__}, not an object of tables")
    return value


def check_creatable_dir(path: Path, *, what: str) -> None:
    """Check, without creating anything, that ``path`` is a directory or can be made one: called before a run's
    setup, so that a directory that cannot be used fails at once and a failure of the setup leaves no directory.

    Args:
        path: the directory. what: the setting it comes from (``"output.dir (--out)"``), for the message.

    Raises:
        ConfigError: ``path`` is a file (or another non-directory), or its nearest existing parent is not a
            writable directory.
    """
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} {str(path)!r} is a file; give a directory (it is created)")
    parent = next((p for p in (path.absolute(), *path.absolute().parents) if p.exists()), None)
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        if parent is not None and parent == path.absolute():
            raise ConfigError(
                f"{what} {str(path)!r} is not writable; give it write permission, or give another directory"
            )
        raise ConfigError(f"{what} {str(path)!r} cannot be created: {str(parent)!r} is not a writable directory")


def _parse_scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a deep copy of ``data`` with ``section.key=value`` overrides applied.

    Values are parsed as TOML scalars (``0.1``, ``true``, ``"x"``, ``[1, 2]``), falling back to the raw string. An
    inline table (``data={alpha=0.1}``) is laid over the table it names, key by key (:func:`merge_mappings`), as
    that many ``section.key=value`` overrides would be: it does not drop the table's other keys.

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
        value = _parse_scalar(raw.strip())
        if isinstance(value, Mapping) and isinstance(node.get(parts[-1]), Mapping):
            value = merge_mappings(node[parts[-1]], value)
        node[parts[-1]] = value
    return result


def merge_mappings(base: Mapping[str, Any], updates: Mapping[str, Any], *, where: str = "") -> dict[str, Any]:
    """A new nested dict: ``base`` with ``updates`` laid over it, table by table (neither is mutated).

    A table in ``updates`` merges into the table of the same key in ``base``; any other value replaces it.

    Raises:
        ConfigError: ``base`` holds a value where ``updates`` has a table (a config file's ``round = 5`` beside a
            ``[round]`` flag): the table's flags would silently replace it, as if the file never said it.
    """
    out: dict[str, Any] = {k: (merge_mappings(v, {}) if isinstance(v, Mapping) else v) for k, v in base.items()}
    for key, value in updates.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_mappings(out[key], value, where=f"{where}{key}.")
        elif isinstance(value, Mapping):
            if key in out:
                raise ConfigError(f"{where}{key}: expected a table, got {out[key]!r}")
            out[key] = merge_mappings(value, {})
        else:
            out[key] = value
    return out


# ---------------------------------------------------------------------------------------------------------------
# network addresses: the one parser for every host:port a user gives (server --address, client --server, ...)

_ADDRESS_EXAMPLE = "e.g. 127.0.0.1:8443, server.example.org:8443 or [::1]:8443"
_MAX_PORT = 65535
_HOST_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


@dataclass(frozen=True)
class Address:
    """A validated ``host:port``.

    Attributes:
        host: an IPv4 address, an IPv6 address (without brackets) or a DNS host name.
        port: 1-65535; 0 only where the OS is to pick a free port (a listening address that allows it).
    """

    host: str
    port: int

    @property
    def is_ipv6(self) -> bool:
        """Whether ``host`` is an IPv6 address (written in brackets in ``host:port`` form)."""
        return ":" in self.host

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if self.is_ipv6 else f"{self.host}:{self.port}"

    def with_port(self, port: int) -> Address:
        """The same host with ``port`` (e.g. the port the OS picked for port 0)."""
        return Address(self.host, port)


def parse_host(text: object, *, what: str) -> str:
    """Check a host given without a port: an IPv4 or IPv6 address, or a DNS host name (RFC 1123 labels).

    Returns:
        The host, stripped of the brackets an IPv6 address may be written in.

    Raises:
        ConfigError: ``text`` is empty, not a string, a malformed IP address or not a valid host name.
    """
    if not isinstance(text, str) or not text:
        raise ConfigError(f"{what}: expected a host name or IP address ({_ADDRESS_EXAMPLE} without the port), "
                          f"got {text!r}")  # fmt: skip
    host = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"{what}: {text!r} is not a valid IPv6 address (e.g. ::1 or fe80::1)") from None
        return host
    if all(part.isdigit() for part in host.split(".")):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ConfigError(
                f"{what}: {text!r} is not a valid IPv4 address (four numbers 0-255, e.g. 127.0.0.1)"
            ) from None
        return host
    labels = host.removesuffix(".").split(".")
    if len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise ConfigError(
            f"{what}: {text!r} is not a valid host name (letters, digits, '-' and '_' in dot-separated labels of at "
            f"most 63 characters, e.g. server.example.org) nor an IP address"
        )
    return host


def parse_address(text: object, *, what: str, allow_port_zero: bool = False) -> Address:
    """Parse and check a ``host:port`` address the user gave (the one parser every address goes through).

    ``host`` is an IPv4 address, a DNS name, or an IPv6 address in brackets (``[::1]:8443``); ``port`` is a
    decimal number 1-65535, or 0 when ``allow_port_zero`` (a listening address where 0 lets the OS pick a free
    port). Called when a config is built, so a bad address fails before any side effect (no state directory, no
    socket).

    Args:
        text: the address as given.
        what: which setting it is (``"--address"``, ``"--server"``), for the message.
        allow_port_zero: accept port 0 (listening addresses only).

    Raises:
        ConfigError: no port, a port out of range or not a number, an IPv6 address without brackets, or a bad
            host; the message says which and shows the right form.
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{what}: expected HOST:PORT ({_ADDRESS_EXAMPLE}), got {text!r}")
    if text != text.strip() or any(c.isspace() for c in text):
        raise ConfigError(f"{what}: {text!r} contains spaces; expected HOST:PORT ({_ADDRESS_EXAMPLE})")
    if "://" in text or text.startswith("unix:"):
        raise ConfigError(f"{what}: {text!r} is a URL; give plain HOST:PORT ({_ADDRESS_EXAMPLE})")
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise ConfigError(f"{what}: {text!r} opens '[' but never closes it; write IPv6 as [::1]:8443")
        host, rest = text[1:close], text[close + 1 :]
        if not rest.startswith(":"):
            raise ConfigError(f"{what}: {text!r} has no port after the IPv6 address; write it as [{host}]:8443")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ConfigError(f"{what}: {text!r} has no port; expected HOST:PORT ({_ADDRESS_EXAMPLE})")
        if ":" in host:
            raise ConfigError(f"{what}: {text!r}: an IPv6 address goes in brackets before the port, e.g. [::1]:8443")
        if not host:
            shown = port_text or "8443"
            example = (  # port 0 is allowed where fedcore listens
                f"0.0.0.0:{shown} to listen on every interface or 127.0.0.1:{shown}"
                if allow_port_zero
                else f"the server's host name or address, as in server.example.org:{shown} or 127.0.0.1:{shown}"
            )
            raise ConfigError(f"{what}: {text!r} has no host; give one, e.g. {example}")
    try:
        host = parse_host(f"[{host}]" if ":" in host else host, what=what)
    except ConfigError as exc:
        raise ConfigError(f"{exc.message}; expected HOST:PORT ({_ADDRESS_EXAMPLE})") from None
    if not port_text.isascii() or not port_text.isdigit():
        raise ConfigError(
            f"{what}: port {port_text!r} in {text!r} is not a number 1-{_MAX_PORT}; expected HOST:PORT "
            f"({_ADDRESS_EXAMPLE})"
        )
    port = int(port_text)
    low = 0 if allow_port_zero else 1
    if not low <= port <= _MAX_PORT:
        zero = " (0 lets the OS pick a free port)" if allow_port_zero else ""
        raise ConfigError(f"{what}: port {port} in {text!r} is out of range {low}-{_MAX_PORT}{zero}; "
                          f"expected HOST:PORT ({_ADDRESS_EXAMPLE})")  # fmt: skip
    return Address(host, port)


def check_port(port: object, *, what: str, allow_zero: bool = False) -> int:
    """Check a TCP port given on its own (e.g. ``metrics_port``): an int 1-65535, or 0 when ``allow_zero``.

    Raises:
        ConfigError: not an int, or out of range.
    """
    low = 0 if allow_zero else 1
    if isinstance(port, bool) or not isinstance(port, int) or not low <= port <= _MAX_PORT:
        zero = " (0 lets the OS pick a free port)" if allow_zero else ""
        raise ConfigError(f"{what} must be a TCP port {low}-{_MAX_PORT}{zero}, got {port!r}")
    return port


def without_effect(key: str, needs: str, flag: str | None = None) -> ConfigError:
    """The refusal of a key given on the command line that the run's other settings leave without effect (the
    run would ignore it, and the user would think it changed something): ``key`` (``flag``) takes effect only
    with ``needs``. Shared by ``fedcore simulate`` and ``fedcore server start``."""
    named = f"{key} ({flag})" if flag else key
    return ConfigError(f"{named} takes effect only with {needs}, which this run has not; drop it, or add that")
