"""Nested frozen dataclasses from YAML-like data: type checks against the annotations, dotted overrides.

``build(cls, data, prefix, source)`` turns a nested dict (parsed YAML) into ``cls``, checking each value
against its field's annotation -- ``bool``, ``int``, ``float``, ``str``, ``Literal[...]``, ``X | None``,
``tuple[X, Y]``, ``dict[...]``, nested dataclasses -- and converting the harmless cases (``1e-4``, which
PyYAML reads as a string, for a float; ``"true"`` for a bool). Any problem is a ``ValueError``
``"<source>: <dotted.key>: <what>"``. ``apply_overrides`` applies ``key=value`` strings (values parsed
as YAML, typed later by ``build``); ``to_plain`` turns a dataclass back into YAML-ready data.

Nothing here knows the run config's schema (that is ``config.py``).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

__all__ = ["apply_overrides", "build", "config_error", "load_yaml_file", "to_plain"]


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):
                continue  # SafeLoader's own construct_mapping says what is wrong with it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    problem=f"key {key!r} appears twice in one mapping", problem_mark=key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml_file(path: Path) -> Any:
    """The YAML data of ``path`` (``None`` for an empty file); each problem is one ``ValueError`` line that
    names the file: a folder, bytes that are not UTF-8, a syntax error (with its line and column), a key
    given twice."""
    if path.is_dir():
        raise ValueError(f"{path}: is a folder, not a YAML file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ValueError(
            f"{path}:{line}: not valid UTF-8 (byte 0x{raw[e.start]:02x}); re-encode the file as UTF-8"
        ) from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = " ".join(x for x in (e.context, e.problem) if x)
        raise ValueError(f"{where}: not valid YAML ({what})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None


def config_error(source: str, key: str, message: str) -> ValueError:
    """The one error shape: ``"<source>: <key>: <message>"``."""
    return ValueError(f"{source}: {key}: {message}")


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check ``value`` against the type annotation ``tp`` (and convert the harmless cases)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise config_error(source, key, "must not be null")
        errors: list[ValueError] = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(value, option, key, source)
            except ValueError as e:
                errors.append(e)
        raise errors[0] if len(errors) == 1 else config_error(source, key, f"bad value {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise config_error(source, key, f"got {value!r}, expected one of {', '.join(map(str, allowed))}")
        return value
    if dataclasses.is_dataclass(tp):
        if value is None:  # null is "off" for a key; for a whole section it would silently be "the defaults"
            raise config_error(source, key, _null_section(tp, key))
        return build(tp, value, key, source)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise config_error(source, key, f"expected a list of {len(args)} numbers, got {value!r}")
        return tuple(
            _coerce(v, a, f"{key}[{i}]", source) for i, (v, a) in enumerate(zip(value, args, strict=True))
        )
    if origin is dict:
        if not isinstance(value, dict):
            raise config_error(source, key, f"expected a mapping, got {value!r}")
        return dict(value)
    return _coerce_scalar(value, tp, key, source)


def _null_section(tp: Any, key: str) -> str:
    """The refusal of a section given as null: null turns a key off, so a null section is ambiguous."""
    names = [f.name for f in dataclasses.fields(tp)]
    nullable = [
        n for n, t in typing.get_type_hints(tp).items() if n in names and type(None) in typing.get_args(t)
    ]
    off = f"; to turn a setting off set that key to null (e.g. {key}.{nullable[0]}: null)" if nullable else ""
    return f"is null; a section is a mapping of its keys: leave it out for its defaults{off}"


def _coerce_scalar(value: Any, tp: Any, key: str, source: str) -> Any:
    if value is None:
        raise config_error(source, key, "must not be null")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise config_error(source, key, f"expected true or false, got {value!r}")
    if tp is int or tp is float:
        return _coerce_number(value, tp, key, source)
    if tp is str:
        if isinstance(value, str):
            return value
        raise config_error(source, key, f"expected a string, got {value!r}")
    raise TypeError(f"unsupported config field type {tp!r} for {key}")


def _coerce_number(value: Any, tp: type, key: str, source: str) -> Any:
    """An int field takes an int, a float field an int or a float; either takes a string that parses
    (PyYAML reads `1e-4` as a string). A bool is neither."""
    numeric = (int,) if tp is int else (int, float)
    if isinstance(value, numeric) and not isinstance(value, bool):
        return tp(value)
    if isinstance(value, str):
        try:
            return tp(value)
        except ValueError:
            pass
    raise config_error(source, key, f"expected {'an integer' if tp is int else 'a number'}, got {value!r}")


def build(cls: Any, data: Any, prefix: str, source: str) -> Any:
    """``cls(**data)`` with every value checked against its annotation (nested dataclasses too)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise config_error(source, prefix or "<top level>", f"expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            where = f"{prefix}.{key}" if prefix else str(key)
            raise config_error(source, where, f"unknown key (known keys: {', '.join(sorted(fields))})")
    kwargs = {k: _coerce(v, hints[k], f"{prefix}.{k}" if prefix else k, source) for k, v in data.items()}
    return cls(**kwargs)


def _set_dotted(data: dict[str, Any], key: str, value: Any, source: str) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise config_error(source, key, f"{part!r} is not a section")
        node = child
    node[parts[-1]] = value


def apply_overrides(data: dict[str, Any], overrides: list[str], source: str = "--set") -> dict[str, Any]:
    """Apply ``key=value`` strings (values parsed as YAML, then typed by the field on validation)."""
    data = yaml.safe_load(yaml.safe_dump(data)) or {}  # deep copy
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{source}: expected KEY=VALUE (e.g. optim.lr=3e-4), got {item!r}")
        _set_dotted(data, key.strip(), _override_value(key.strip(), text, source), source)
    return data


def _override_value(key: str, text: str, source: str) -> Any:
    """The YAML value of one ``KEY=VALUE`` (``None`` for an empty value); text that does not parse is one
    line naming the key, with the advice to quote it (``--set 'run.name="a{b"'``)."""
    if not text.strip():
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        what = " ".join(x for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x)
        raise config_error(
            source,
            key,
            f"value {text!r} is not valid YAML ({what or 'does not parse'}); give a number, true/false, null, "
            f"a [list] or a {{mapping}}, or quote a string: {key}={json.dumps(text)}",
        ) from None


def to_plain(obj: Any) -> Any:
    """A dataclass as nested dicts / lists / scalars (tuples become lists), ready for ``yaml.safe_dump``."""

    def plain(x: Any) -> Any:
        if isinstance(x, tuple):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    return plain(dataclasses.asdict(obj))
