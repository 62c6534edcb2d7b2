"""Settings checked against their dataclass annotations, so a YAML `null` or a string where a number belongs gets
a message naming the setting instead of a TypeError from the first comparison that meets it."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

_NAMES = {int: "a whole number", float: "a number", str: "a string", bool: "true or false", dict: "a mapping",
          list: "a list", type(None): "null"}


def _accepted(hint: Any) -> tuple[type, ...] | None:
    """The plain types a hint allows (None: anything, e.g. Any)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [_accepted(arg) for arg in typing.get_args(hint)]
        return None if any(p is None for p in parts) else tuple(t for p in parts if p for t in p)
    base = origin or hint
    return (base,) if base in _NAMES else None


def _fits(value: Any, kind: type) -> bool:
    if kind is float:  # a YAML 1 is a fine 1.0; true is not a number
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def read_settings_file(path: str | Path) -> Any:
    """A settings file's YAML (None when empty); ValueError naming the file and the place for text that is not
    YAML, as for any other bad setting (a traceback before)."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not YAML: {' '.join(str(exc).split())}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not text") from None


def check_port(port: int, name: str = "port") -> None:
    """ValueError unless `port` is a TCP port (an out-of-range one wrapped silently into another port)."""
    if not 0 < port < 65536:
        raise ValueError(f"{name} {port} is not a TCP port (1-65535)")


def check_http_url(url: str, what: str) -> None:
    """ValueError unless `url` is an http(s) URL with a host and a numeric port, if any: a pod's or a router's
    base URL, which was otherwise taken and failed at every request."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises for a port that is not a number or out of range
    except ValueError as exc:
        raise ValueError(f"{what} {url!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{what} {url!r} is not an http(s) URL with a host, e.g. http://10.0.0.7:8080")


def check_types(settings: Any, what: str) -> None:
    """ValueError naming the first field of dataclass `settings` whose value its annotation does not allow."""
    hints = typing.get_type_hints(type(settings))
    for field in dataclasses.fields(settings):
        kinds = _accepted(hints[field.name])
        value = getattr(settings, field.name)
        if kinds is not None and not any(_fits(value, kind) for kind in kinds):
            wanted = " or ".join(_NAMES[kind] for kind in kinds)
            raise ValueError(f"{what} setting {field.name} must be {wanted}, not {value!r}")
