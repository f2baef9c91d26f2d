"""Checks the ``dask_services`` config section, so that a bad value fails where it is set
to use (building a graph, deploying a service) with its key named, not deep in a worker or
the scheduler's graph handling.

Each key has a kind: a count (an integer, with a least value), a duration (``"30s"``,
seconds as a number), a size (``"64 MiB"``, bytes), a fraction in ``(0, 1]``, a boolean,
a list of ``"module:attribute"`` imports; some also take ``null``.  :func:`check_config`
checks every key set (keys absent, which the code reads with a default, are skipped) and
raises ``ValueError`` naming the key, the value, what it should be, and the default.
"""

from __future__ import annotations

import sys
from typing import Any

import dask.config
from dask.utils import parse_bytes, parse_timedelta

from dask_services.config import packaged_default

# key (under dask_services.) -> (kind, least value for counts and durations, null allowed)
KEYS: dict[str, tuple[str, float, bool]] = {
    "restarts": ("count", 0, False),
    "unproduced-timeout": ("duration", 0, True),
    "local-instances": ("count", 1, False),
    "hand-off-buffer": ("size", 0, False),
    "stop-grace": ("duration", 0, False),
    "threads": ("count", 1, True),
    "bulk-lane": ("bool", 0, False),
    "fuse-consumers": ("bool", 0, False),
    "extensions": ("imports", 0, False),
    "shuffle.buffer-fraction": ("fraction", 0, False),
    "shuffle.bytes-in-flight": ("size", 1, False),
    "shuffle.groups": ("count", 1, False),
    "shuffle.fuse-compute": ("bool", 0, False),
    "rechunk.buffer-fraction": ("fraction", 0, False),
    "rechunk.copy-max-inputs": ("count", 0, False),
    "rechunk.slice-saving": ("size", 0, False),
    "rechunk.merge-region-max": ("size", 0, False),
    "rechunk.bytes-in-flight": ("size", 1, False),
    "rechunk.pairs-per-task": ("count", 1, False),
    "replicated.health-check-period": ("duration", 1e-3, False),  # or 0: no probes
    "replicated.health-check-timeout": ("duration", 1e-3, False),
    "replicated.setup-attempts": ("count", 1, False),
    "replicated.setup-timeout": ("duration", 0, False),
    "replicated.deploy-timeout": ("duration", 0, False),
    "replicated.call-retries": ("count", 0, False),
    "replicated.retry-backoff": ("duration", 0, False),
    "replicated.retry-backoff-max": ("duration", 0, False),
    "replicated.connect-timeout": ("duration", 1e-3, False),
    "replicated.refresh-interval": ("duration", 0, False),
    "replicated.drain-timeout": ("duration", 0, False),
    "replicated.stream-window": ("count", 1, False),
    "replicated.autoscaling-interval": ("duration", 1e-3, False),
    "story.entries": ("count", 1, False),
    "story.runs": ("count", 1, False),
    "status.recent-runs": ("count", 1, False),
}

_WHAT = {
    "count": "an integer",
    "duration": 'a duration such as "30s" or "250ms" (or seconds as a number)',
    "size": 'a size such as "64 MiB" (or bytes as a number)',
    "fraction": "a number greater than 0 and at most 1",
    "bool": "true or false",
    "imports": 'a list of "module:attribute" strings (or one string of them separated by '
               'commas)',
}

_MISSING = object()
# durations whose 0 turns something off (else at least their least value)
ZERO_TURNS_OFF = frozenset({"replicated.health-check-period"})


def as_count(value: Any) -> int:
    """A count given as an int, or as a whole number in a string or a float (``"4"``,
    ``4.0``: every reader takes those); ``ValueError`` or ``TypeError`` otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"{value!r} is not a count")
    number = int(value)
    if isinstance(value, float) and value != number:
        raise ValueError(f"{value!r} is not a whole number")
    return number


def as_imports(value: Any) -> list[str]:
    """``"module:attribute"`` strings given as a list, or as one string separated by
    commas (as an environment variable gives them); ``TypeError`` or ``ValueError``
    otherwise."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{value!r} is not a list")
    for spec in value:
        if not (isinstance(spec, str) and all(spec.partition(":"))):
            raise ValueError(f"{spec!r} is not 'module:attribute'")
    return list(value)


def _problem(kind: str, least: float, value: Any) -> str | None:
    """What is wrong with ``value`` for a key of this kind, or None."""
    if kind == "bool":
        return None if isinstance(value, bool) else _WHAT[kind]
    if kind == "imports":
        try:
            as_imports(value)
        except (TypeError, ValueError):
            return _WHAT[kind]
        return None
    if isinstance(value, bool):
        return _WHAT[kind]
    try:
        if kind == "count":
            number: float = as_count(value)
            if number > sys.maxsize:  # sizes a deque or a list by it
                return f"{_WHAT[kind]}, at most {sys.maxsize}"
        elif kind == "duration":
            number = float(parse_timedelta(value))
        elif kind == "size":
            number = parse_bytes(value)
        else:
            number = float(value)
            if not 0 < number <= 1:
                return _WHAT[kind]
    except Exception:  # not parsed: "", [], "1e400" (OverflowError), ...
        return _WHAT[kind]
    if number < least:
        bound = "at least 1" if kind == "count" and least == 1 else (
            f"at least {least * 1000:g} ms" if kind == "duration" and least > 0 else
            "positive" if least > 0 else "not negative")
        return f"{_WHAT[kind]}, {bound}"
    return None


def check_config() -> None:
    """Raise ``ValueError`` for the first ``dask_services`` config value that is not
    valid, naming it and what it should be."""
    for key in KEYS:
        check_key(key)


def check_key(key: str) -> None:
    """Raise ``ValueError`` if ``dask_services.<key>`` is set to a value that is not
    valid, naming it and what it should be."""
    kind, least, nullable = KEYS[key]
    full = f"dask_services.{key}"
    value = dask.config.get(full, _MISSING)
    if value is _MISSING or (nullable and (value is None or value is False)):
        return
    problem = _problem(kind, least, value)
    if problem is None:
        return
    if key in ZERO_TURNS_OFF and _problem(kind, 0, value) is None:
        if float(parse_timedelta(value)) == 0:
            return
        problem += " (or 0, to turn it off)"
    raise ValueError(  # every key has a packaged default (tested)
        f"config value {full}={value!r} is not valid: it should be {problem}"
        f"{' or null' if nullable else ''} (default {packaged_default(key)!r}); fix it "
        "in dask.config.set(...), your dask config files or the "
        "DASK_DASK_SERVICES__... environment variables")
