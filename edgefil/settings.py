"""One config language: every file kind (device, coordinator, fleet) is a tree of dataclasses, checked by `build`.

A file is TOML; each table is a frozen dataclass whose fields (and their types) are the table's valid keys. `build`
walks the tree once: an unknown key, a missing one, a value of the wrong type, or a value the dataclass itself
refuses (its `__post_init__`) becomes one `ConfigError` whose message names the file, the table and the key and
says what is valid — one line, no traceback (the command line prints it and exits). Open tables whose keys belong
to another component (a policy's or a strategy's options, a scenario) are `Mapping[str, Any]` here and checked by
their owner with `check_options`, against the constructor that will take them, with the same kind of message.

Nothing here imports a side: the device, the coordinator and the simulator each describe their files with it.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar, Union

import tomllib

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file that cannot be used; the message is one line naming file, table and key."""


@dataclasses.dataclass(frozen=True)
class Where:
    """A place in a config file, for messages: `file` and the dotted `table` ("" for the top level)."""

    file: str
    table: str = ""

    def inner(self, key: str) -> Where:
        return Where(self.file, f"{self.table}.{key}" if self.table else key)

    def error(self, key: str | None, problem: str) -> ConfigError:
        table = f"[{self.table}] " if self.table else ""
        return ConfigError(f"{self.file}: {table}{key + ': ' if key else ''}{problem}")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))  # a JSON string of ASCII escapes is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def dump_toml(data: Mapping[str, Any], inline: tuple[str, ...] = ("scenario",)) -> str:
    """A config file's text: top-level values first, then a [table] per mapping (deeper mappings, and the
    top-level ones named in `inline`, as inline tables). What the configs written by the product need
    (generated credentials, the simulator's and the benchmarks' files), not a general TOML writer."""
    plain = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, Mapping) or k in inline]
    tables = [f"[{k}]\n" + "".join(f"{kk} = {_toml_value(vv)}\n" for kk, vv in v.items())
              for k, v in data.items() if isinstance(v, Mapping) and k not in inline]
    return "\n".join(plain) + ("\n\n" if plain else "") + "\n".join(tables)


def load_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as a dict; ConfigError (one line) when it is missing or not TOML."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None


# a class's or function's annotated types, resolved once a process (read only): a fleet worker builds the same
# config classes for each of its thousands of devices, and resolving them again was 3.6 ms of a device's start
_type_hints: Callable[[Any], dict[str, Any]] = functools.cache(typing.get_type_hints)


def build(cls: type[T], raw: Any, where: Where, base: Path | None = None) -> T:
    """An instance of the dataclass `cls` from a parsed table, checked key by key (see the module docstring).
    Relative paths (fields typed Path) are taken relative to `base`."""
    if not isinstance(raw, Mapping):
        raise where.error(None, f"expected a table, got {_kind(raw)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise where.error(unknown[0], f"unknown key; valid keys: {', '.join(sorted(fields))}")
    hints = _type_hints(cls)
    values = {}
    for name, field in fields.items():
        if name not in raw:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise where.error(name, "missing (required)")
            continue
        values[name] = convert(hints[name], raw[name], where, name, base)
    try:
        return cls(**values)
    except (ValueError, TypeError) as err:
        raise where.error(None, str(err)) from None


def check_options(target: Callable[..., Any], raw: Mapping[str, Any], where: Where,
                  skip: tuple[str, ...] = (), also: tuple[str, ...] = ()) -> dict[str, Any]:
    """The keyword options `raw` checked against `target`'s signature (names and annotated types); `skip` names
    parameters the caller passes itself, `also` keys of the table the caller handles (listed as valid, not
    checked here)."""
    signature = inspect.signature(target)
    hints = _parameter_hints(target)
    params = {n: p for n, p in signature.parameters.items()
              if n not in skip and n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = sorted(set(raw) - set(params) - set(also))
    if unknown:
        valid = ", ".join(sorted({*params, *also})) or "none"
        raise where.error(unknown[0], f"unknown key; valid keys: {valid}")
    return {name: convert(hints.get(name, Any), value, where, name, None)
            for name, value in raw.items() if name not in also}


def _parameter_hints(target: Callable[..., Any]) -> dict[str, Any]:
    """The annotated types of a function's parameters, or of a class's constructor (its own or inherited)."""
    if isinstance(target, type):
        for klass in target.__mro__:
            if "__init__" in vars(klass):
                return _type_hints(vars(klass)["__init__"])
        return {}
    return _type_hints(target)


def convert(expected: Any, value: Any, where: Where, key: str, base: Path | None) -> Any:
    """`value` as the annotated type `expected`, or ConfigError naming the key and the type wanted."""
    origin = typing.get_origin(expected)
    if expected is Any:
        return value
    if origin in (Union, types.UnionType):
        options = typing.get_args(expected)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return convert(option, value, where, key, base)
            except ConfigError as err:
                errors.append(err)
        if len(errors) == 1:  # one type it could be: its own message says more
            raise errors[0]
        raise where.error(key, f"expected {_name(expected)}, got {_kind(value)}")
    if origin is typing.Literal:
        if value not in typing.get_args(expected):
            raise where.error(key, f"expected one of {', '.join(map(repr, typing.get_args(expected)))}, "
                                   f"got {value!r}")
        return value
    if dataclasses.is_dataclass(expected) and isinstance(expected, type):
        return build(expected, value, where.inner(key), base)
    if expected is bool:
        if not isinstance(value, bool):
            raise where.error(key, f"expected true or false, got {_kind(value)}")
        return value
    if expected is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise where.error(key, f"expected an integer, got {_kind(value)}")
        return value
    if expected is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise where.error(key, f"expected a number, got {_kind(value)}")
        return float(value)
    if expected is str:
        if not isinstance(value, str):
            raise where.error(key, f"expected a string, got {_kind(value)}")
        return value
    if expected is Path:
        if isinstance(value, Path):
            value = str(value)
        if not isinstance(value, str):
            raise where.error(key, f"expected a path (string), got {_kind(value)}")
        return (base / value).resolve() if base is not None else Path(value)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise where.error(key, f"expected a list, got {_kind(value)}")
        item = (typing.get_args(expected) or (Any,))[0]
        items = [convert(item, v, where, key, base) for v in value]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping, typing.Mapping) or expected in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise where.error(key, f"expected a table, got {_kind(value)}")
        args = typing.get_args(expected)
        if args and args[1] is not Any:
            return {k: convert(args[1], v, where.inner(key), str(k), base) for k, v in value.items()}
        return dict(value)
    return value


def _name(expected: Any) -> str:
    if typing.get_origin(expected) in (Union, types.UnionType):
        return " or ".join(_name(o) for o in typing.get_args(expected) if o is not type(None))
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", Path: "a path"}
    return names.get(expected, getattr(expected, "__name__", str(expected)))


def _kind(value: Any) -> str:
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, bool):
        return f"{str(value).lower()}"
    return f"{type(value).__name__} {value!r}"
