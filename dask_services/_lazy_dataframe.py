"""The ``"service"`` shuffle method registered with dask.dataframe when dask.dataframe is
imported, not when ``dask_services`` is.

Importing dask.dataframe brings pandas and pyarrow: ~85 MB and ~0.6 s per process.  Every
worker of a cluster imports ``dask_services`` (its plugins), most for arrays or replicated
services only, and the scheduler does.  So ``dask_services`` imports its ``dataframe``
subpackage (which registers the method) at once only where dask.dataframe is already
imported; elsewhere a finder on ``sys.meta_path`` waits for dask.dataframe's import and
imports the subpackage right after it, before anything can build or unpickle a
DataFrame collection (the scheduler unpickles the collections clients send and lowers
them there).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

WATCHED = "dask.dataframe"
SUBPACKAGE = "dask_services.dataframe"


def install() -> None:
    """Register the shuffle method now if dask.dataframe is imported, else once it is
    (idempotent)."""
    if WATCHED in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterDataFrameImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDataFrameImport())


def _register() -> None:
    import dask_services.dataframe  # noqa: F401  (registers the "service" method)


def _uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterDataFrameImport)]


class _AfterDataFrameImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader other finders give for dask.dataframe so
    that the subpackage is imported once dask.dataframe has been executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _ThenRegister(spec.loader)
        return spec


class _ThenRegister(importlib.abc.Loader):
    """dask.dataframe's own loader, followed by the registration."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _uninstall()
        try:
            _register()
        except Exception as e:  # noqa: BLE001 - dask.dataframe itself must still import
            warnings.warn(f"dask_services could not register its 'service' shuffle method "
                          f"with dask.dataframe: {type(e).__name__}: {e}", stacklevel=2)

    def __getattr__(self, name: str) -> Any:  # get_data, get_resource_reader, ...
        return getattr(self._loader, name)
