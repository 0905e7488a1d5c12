"""Warm-up policies by name, through Python entry points.

Built-ins and third-party policies register alike, in the
``lmcache_tiered.warmup_policies`` group of their package metadata::

    [project.entry-points."lmcache_tiered.warmup_policies"]
    my_policy = "my_package.module:MyPolicy"

``tiered.warmup.policy: my_policy`` selects one; ``tiered.warmup.my_policy.P``
sets the keyword parameter ``P`` of its constructor. YAML may give a number as
a string, so each value is converted to the type of the parameter's annotation
(or default): bool, int, float or str, optionally ``| None``. A policy rejects
an out-of-range value with ``ValueError("P: must be ...")``, which becomes a
ConfigError naming ``tiered.warmup.my_policy.P``.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any

from lmcache_tiered.config import PREFIX, ConfigError
from lmcache_tiered.config.parse import parse_bool, parse_float, parse_int
from lmcache_tiered.warmup.base import CacheView, WarmupPolicy

GROUP = "lmcache_tiered.warmup_policies"

_PARSERS: dict[type, Callable[[str, Any], Any]] = {
    bool: parse_bool,
    int: parse_int,
    float: parse_float,
    str: lambda key, value: str(value),
}


def installed_policies() -> list[str]:
    """Names of the policies installed in this environment, sorted."""
    return sorted({ep.name for ep in entry_points(group=GROUP)})


def load_policy(name: str, view: CacheView, params: Mapping[str, Any]) -> WarmupPolicy:
    """Build the policy registered as ``name`` over ``view``, with ``params``
    (raw values of ``tiered.warmup.<name>.<param>``, keyed by ``<param>``)."""
    found = {ep.value: ep for ep in entry_points(group=GROUP, name=name)}
    if not found:
        raise ConfigError(
            f"{PREFIX}warmup.policy: no warm-up policy named {name!r} is installed; "
            f"installed: {', '.join(installed_policies()) or 'none'} "
            f"(entry point group {GROUP})"
        )
    if len(found) > 1:
        raise ConfigError(
            f"{PREFIX}warmup.policy: {name!r} is registered by several packages "
            f"({', '.join(sorted(found))}); uninstall all but one"
        )
    (entry,) = found.values()
    try:
        cls = entry.load()
    except Exception as exc:
        raise ConfigError(
            f"{PREFIX}warmup.policy: policy {name!r} ({entry.value}) failed to "
            f"import: {type(exc).__name__}: {exc}"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, WarmupPolicy)):
        raise ConfigError(
            f"{PREFIX}warmup.policy: entry point {name!r} ({entry.value}) is not "
            "a WarmupPolicy subclass"
        )
    kwargs = _convert(name, cls, params)
    try:
        return cls(view, **kwargs)
    except ValueError as exc:
        raise ConfigError(f"{PREFIX}warmup.{name}.{exc}") from exc


def _convert(
    name: str, cls: type[WarmupPolicy], params: Mapping[str, Any]
) -> dict[str, Any]:
    """Check each parameter name against the constructor, convert its value."""
    signature = inspect.signature(cls)
    accepted = {
        p.name: p
        for p in list(signature.parameters.values())[1:]  # after the view
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    try:
        hints = typing.get_type_hints(cls.__init__)
    except (NameError, TypeError):  # annotations it cannot resolve: use defaults
        hints = {}
    kwargs = {}
    for param, value in params.items():
        key = f"{PREFIX}warmup.{name}.{param}"
        if param not in accepted:
            known = ", ".join(f"{PREFIX}warmup.{name}.{p}" for p in accepted)
            raise ConfigError(
                f"{key}: policy {name!r} has no parameter {param!r}; "
                + (f"its parameters: {known}" if known else "it takes none")
            )
        default = accepted[param].default
        no_default = default is None or default is inspect.Parameter.empty
        fallback = None if no_default else type(default)
        kwargs[param] = _coerce(key, hints.get(param, fallback), value)
    return kwargs


def _coerce(key: str, kind: Any, value: Any) -> Any:
    """``value`` as ``kind`` (a parser's type, or one of them ``| None``);
    passed through unchanged when ``kind`` is anything else."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(options) < len(typing.get_args(kind)) and _is_none(value):
            return None
        kind = options[0] if len(options) == 1 else None
    parse = _PARSERS.get(kind) if isinstance(kind, type) else None
    return value if parse is None else parse(key, value)


def _is_none(value: Any) -> bool:
    return value is None or (
        isinstance(value, str) and value.strip().lower() in ("", "none", "null")
    )
