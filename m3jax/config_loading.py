"""YAML <-> frozen config dataclasses, with `key=value` overrides and errors that name the key.

A YAML file maps 1:1 onto the dataclass fields. Unknown keys, wrong types and values rejected by a
dataclass's `__post_init__` all raise `ConfigError` with the file and the dotted key, e.g.
`configs/demo.yaml: unknown key 'model.num_head' (did you mean 'num_heads'?)`.
"""

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config file, an override or a value inside them is wrong; the message says where."""


def load_yaml(path: str | os.PathLike) -> dict:
    """Reads a YAML mapping; a missing, unreadable or malformed file raises ConfigError."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read config file ({e})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: malformed YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Returns a copy of `data` with each `dotted.key=value` set; values are parsed as YAML scalars."""
    data = _deep_copy(data)
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {override!r}: expected key=value")
        try:
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError:
            raise ConfigError(f"override {override!r}: value is not valid YAML") from None
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {override!r}: '{part}' is not a section")
            node = child
        node[leaf] = value
    return data


def from_mapping(cls: type, data: Mapping, *, where: str, prefix: str = "") -> Any:
    """Builds dataclass `cls` from a nested mapping, checking keys and types field by field."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: '{prefix.rstrip('.') or '<root>'}' must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{where}: unknown key '{prefix}{key}'{hint}")
    kwargs = {key: _coerce(hints[key], value, where, prefix + key) for key, value in data.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        section = prefix.rstrip(".") or cls.__name__
        raise ConfigError(f"{where}: {section}: {e}") from None


def to_mapping(config: Any) -> dict:
    """The plain-YAML form of a config dataclass (tuples become lists)."""
    return _plain(dataclasses.asdict(config))


def _coerce(hint: Any, value: Any, where: str, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        (hint,) = [option for option in options if option is not type(None)]
        origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return from_mapping(hint, value if value is not None else {}, where=where, prefix=key + ".")
    if origin is tuple:
        item_type = typing.get_args(hint)[0]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: '{key}' must be a list, got {value!r}")
        return tuple(_coerce(item_type, item, where, f"{key}[{i}]") for i, item in enumerate(value))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # YAML 1.1 reads "3e-4" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if hint in (int, float, str, bool) and (
        not isinstance(value, hint) or (hint is int and isinstance(value, bool))
    ):
        raise ConfigError(f"{where}: '{key}' must be {hint.__name__}, got {value!r}")
    return value


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    return data


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
