"""Registers the ``dask_services`` section of the dask config, with its defaults."""

from __future__ import annotations

import os

import dask.config
import yaml

_fn = os.path.join(os.path.dirname(__file__), "dask_services.yaml")
with open(_fn) as f:
    defaults = yaml.safe_load(f)

dask.config.update_defaults(defaults)
