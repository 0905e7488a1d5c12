"""Parsers of setting values: each takes the key (for its error) and the raw
value from YAML or JSON, and returns the value or raises a
:class:`ConfigError` that names the key and says what to give instead. Used
by the settings table and by anything else that reads a setting's kind of
value (warm-up policies' parameters, the command lines)."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from typing import Any


class ConfigError(ValueError):
    """A ``tiered.*`` setting is missing, unknown or has a bad value."""


Parser = Callable[[str, Any], Any]


def parse_paths(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        items = [p.strip() for p in value.split(",")]
    elif isinstance(value, (list, tuple)):
        items = [str(p).strip() for p in value]
    else:
        raise ConfigError(
            f"{key}: expected a list of directories or a comma-separated string, "
            f"got {type(value).__name__} {value!r}"
        )
    paths = tuple(os.path.abspath(os.path.expanduser(p)) for p in items if p)
    if not paths:
        raise ConfigError(f"{key}: no directory given; list one directory per device")
    if len(set(paths)) != len(paths):
        raise ConfigError(f"{key}: a directory is listed twice: {list(paths)}")
    return paths


def list_of(parse: Parser) -> Parser:
    """A list of values ``parse`` takes (or a comma-separated string), at
    least one, none twice."""

    def parse_list(key: str, value: Any) -> tuple[Any, ...]:
        if isinstance(value, str):
            value = [item.strip() for item in value.split(",") if item.strip()]
        if not isinstance(value, (list, tuple)) or not value:
            raise ConfigError(
                f"{key}: expected a list or a comma-separated string, got {value!r}"
            )
        items = tuple(parse(key, item) for item in value)
        if len(set(items)) != len(items):
            raise ConfigError(f"{key}: an item is listed twice: {list(items)}")
        return items

    return parse_list


def parse_file(key: str, value: Any) -> str:
    """A file's path, absolute (the file itself is checked where it is used)."""
    text = str(value).strip()
    if not text:
        raise ConfigError(f"{key}: expected a file's path, got {value!r}")
    return os.path.abspath(os.path.expanduser(text))


def parse_adapter(key: str, value: Any) -> dict[str, Any]:
    """The adapter spec of ``tiered.cold.adapter``: a JSON object (text, or a
    mapping from YAML) with a ``type``; ConfigError otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{key}: not valid JSON ({exc}); give the JSON LMCache's "
                """--l2-adapter takes, e.g. {"type": "resp", "host": "127.0.0.1", """
                '"port": 6379}'
            ) from None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ConfigError(
            f'{key}: expected a JSON object with a "type" (an LMCache L2 adapter '
            f"type such as resp, valkey, s3, mooncake_store, fs), got {value!r}"
        )
    return dict(value)


def parse_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    return number


def parse_int(key: str, value: Any) -> int:
    number = parse_float(key, value)
    if number != int(number):
        raise ConfigError(f"{key}: expected a whole number, got {value!r}")
    return int(number)


def parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def choice(*choices: str) -> Callable[[str, Any], str]:
    def parse(key: str, value: Any) -> str:
        text = str(value).strip().lower()
        if text not in choices:
            raise ConfigError(
                f"{key}: expected one of {', '.join(choices)}, got {value!r}"
            )
        return text

    return parse


def positive(parse: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    def parse_positive(key: str, value: Any) -> Any:
        number = parse(key, value)
        if number <= 0:
            raise ConfigError(f"{key}: must be greater than 0, got {value!r}")
        return number

    return parse_positive


def in_range(
    parse: Callable[[str, Any], Any], low: float, high: float = math.inf
) -> Callable[[str, Any], Any]:
    def parse_in_range(key: str, value: Any) -> Any:
        number = parse(key, value)
        if not low <= number <= high:
            limits = (
                f"at least {low:g}"
                if high == math.inf
                else f"between {low:g} and {high:g}"
            )
            raise ConfigError(f"{key}: must be {limits}, got {value!r}")
        return number

    return parse_in_range


def parse_fraction(key: str, value: Any) -> float:
    number = parse_float(key, value)
    if not 0.0 <= number <= 1.0:
        raise ConfigError(f"{key}: must be between 0 and 1, got {value!r}")
    return number


def parse_host_id(key: str, value: Any) -> str:
    text = str(value).strip()
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", text):
        raise ConfigError(
            f"{key}: expected 1-64 letters, digits, '.', '_' or '-', got {value!r}"
        )
    return text


def parse_mode(key: str, value: Any) -> int:
    """Octal permission bits: "0660" (string) or an int as YAML may give it
    (YAML reads 0660 as octal, but 660 as a decimal number)."""
    expected = f'{key}: expected octal permission bits like "0600", got {value!r}'
    try:
        mode = value if isinstance(value, int) else int(str(value), 8)
    except ValueError:
        raise ConfigError(expected) from None
    if not 0 <= mode <= 0o777 or isinstance(mode, bool):
        if isinstance(value, int) and re.fullmatch("[0-7]{3}", str(value)):
            expected += f' (YAML reads {value} as a decimal number: write "0{value}")'
        raise ConfigError(expected)
    if mode & 0o600 != 0o600:
        raise ConfigError(
            f"{key}: {mode:04o} does not let the owner read and write its own "
            'files; give at least "0600"'
        )
    return mode
