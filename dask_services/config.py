"""Registers the ``dask_services`` section of the dask config, with its defaults, and reads
it (:func:`setting`) so that a config without the section still works."""

from __future__ import annotations

import os
from typing import Any

import dask.config
import yaml

_fn = os.path.join(os.path.dirname(__file__), "dask_services.yaml")
with open(_fn) as f:
    defaults = yaml.safe_load(f)

dask.config.update_defaults(defaults)


_MISSING = object()


def packaged_default(name: str) -> Any:
    """The value of ``dask_services.<name>`` in the package's own ``dask_services.yaml``.

    Raises ``KeyError`` for a name the package does not define."""
    try:
        return dask.config.get(f"dask_services.{name}", config=defaults)
    except KeyError:
        raise KeyError(f"dask_services.{name}") from None


def setting(name: str) -> Any:
    """``dask_services.<name>`` from the dask config, or the packaged default where the
    config has no such key.

    The config can lose the whole section after import: ``dask.config.refresh()`` or a
    reset to a copy taken before ``dask_services`` was imported (distributed's test
    utilities reset to theirs around every ``gen_cluster`` test) leaves only what the
    config files and environment say.  Every read goes through here instead of a bare
    ``dask.config.get``."""
    value = dask.config.get(f"dask_services.{name}", _MISSING)
    return packaged_default(name) if value is _MISSING else value
