"""The ``"service"`` shuffle and rechunk methods registered with dask.dataframe and
dask.array when those are imported, not when ``dask_services`` is.

Importing dask.dataframe brings pandas and pyarrow: ~85 MB and ~0.6 s per process;
dask.array ~8 MB and ~0.3 s.  Every worker of a cluster imports ``dask_services`` (its
plugins), most for one kind of work only (arrays, DataFrames or replicated services), and
the scheduler does.  So ``dask_services`` imports its ``dataframe`` and ``array``
subpackages (which register the methods) at once only where dask.dataframe or dask.array
is already imported; elsewhere a finder on ``sys.meta_path`` waits for that import and
imports the subpackage right after it, before anything can build or unpickle a
collection (the scheduler unpickles the collections clients send and lowers them there).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

#: the dask module whose import registers a method -> the subpackage that registers it
SUBPACKAGES = {
    "dask.dataframe": "dask_services.dataframe",
    "dask.array": "dask_services.array",
}
METHOD_KIND = {"dask.dataframe": "shuffle", "dask.array": "rechunk"}


def install() -> None:
    """Register each method now if its dask module is imported, else once it is
    (idempotent)."""
    waiting = set()
    for watched in SUBPACKAGES:
        if watched in sys.modules:
            _register(watched)
        else:
            waiting.add(watched)
    if waiting and _finder() is None:
        sys.meta_path.insert(0, _AfterImport(waiting))


def _register(watched: str) -> None:
    importlib.import_module(SUBPACKAGES[watched])


def _finder() -> _AfterImport | None:
    return next((f for f in sys.meta_path if isinstance(f, _AfterImport)), None)


def _uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterImport)]


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader other finders give for a watched module so
    that its subpackage is imported once the module has been executed."""

    def __init__(self, waiting: set[str]) -> None:
        self.waiting = set(waiting)

    def find_spec(self, fullname: str, path: Any, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.waiting:
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
        spec.loader = _ThenRegister(spec.loader, fullname, self)
        return spec


class _ThenRegister(importlib.abc.Loader):
    """The watched module's own loader, followed by the registration."""

    def __init__(self, loader: Any, watched: str, finder: _AfterImport) -> None:
        self._loader = loader
        self._watched = watched
        self._finder = finder

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._finder.waiting.discard(self._watched)
        if not self._finder.waiting:
            _uninstall()
        try:
            _register(self._watched)
        except Exception as e:  # noqa: BLE001 - dask's module itself must still import
            warnings.warn(f"dask_services could not register its 'service' "
                          f"{METHOD_KIND[self._watched]} method with {self._watched}: "
                          f"{type(e).__name__}: {e}", stacklevel=2)

    def __getattr__(self, name: str) -> Any:  # get_data, get_resource_reader, ...
        return getattr(self._loader, name)
