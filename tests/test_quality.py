"""Project hygiene that the test command also checks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_ruff_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    result = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(30)
def test_every_public_name_has_a_docstring():
    import dask_services

    for name in dask_services.__all__:
        obj = getattr(dask_services, name)
        assert (obj.__doc__ or "").strip(), f"dask_services.{name} has no docstring"


PUBLIC_MODULES = ("dask_services", "dask_services.array", "dask_services.dataframe",
                  "dask_services.examples")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_of_the_subpackages_has_a_docstring(module):
    """Modules, the names in their ``__all__`` and the public methods of public classes
    (an overriding hook inherits the documentation of the hook it overrides)."""
    import importlib
    import inspect

    mod = importlib.import_module(module)
    assert (mod.__doc__ or "").strip(), f"module {module} has no docstring"
    missing = []
    for name in mod.__all__:
        obj = getattr(mod, name)
        if isinstance(obj, (str, int, float)):
            continue  # constants, e.g. METHOD
        if not (inspect.getdoc(obj) or "").strip():
            missing.append(f"{module}.{name}")
        if inspect.isclass(obj):
            for attr, value in vars(obj).items():
                if not attr.startswith("_") and callable(value) \
                        and not (inspect.getdoc(getattr(obj, attr)) or "").strip():
                    missing.append(f"{module}.{name}.{attr}")
    assert not missing, missing


# ------------------------------------------------------------------ the core names no extension

CORE = ("service", "_run_state", "_run_events", "_run_model", "_run_story", "_run_placement",
        "_run_log", "_graph_intake", "scheduler", "worker", "_host", "graph")
EXTENSIONS = ("dask_services.replicated", "dask_services.dataframe", "dask_services.array",
              "dask_services._observe", "dask_services._status", "dask_services._metrics",
              "dask_services.dashboard", "dask_services.cli")


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """``(module, line, at module level)`` of every import in ``path``, function-level
    and ``TYPE_CHECKING`` ones included; relative imports resolved."""
    import ast

    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    package = "dask_services"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([package] + ([base] if base else []))
            found.append((base, node.lineno, id(node) in top))
            # ``from dask_services import replicated`` names a module too
            found += [(f"{base}.{alias.name}", node.lineno, id(node) in top)
                      for alias in node.names]
    return found


def _is_extension(module: str) -> bool:
    return any(module == e or module.startswith(e + ".") for e in EXTENSIONS)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", CORE)
def test_the_core_imports_no_extension(name):
    """The service-task core (service, run state, scheduler and worker plugins, host,
    graph) names no extension: not replicated services, not the shuffle or the rechunk,
    not the diagnostics, not the CLI; in no import at all, at module level, in a function
    or for type checking.  Extensions plug in from outside (``_plugins.py``)."""
    path = ROOT / "dask_services" / f"{name}.py"
    bad = [f"{path.name}:{line}: {module}" for module, line, _ in _imports(path)
           if _is_extension(module)]
    assert not bad, bad


@pytest.mark.timeout(30)
def test_nothing_the_core_imports_at_module_level_imports_an_extension():
    """Following module-level imports from the core through every dask_services module
    they reach never leads to an extension (``_deployable.py`` imports the replicated
    package only inside ``Service.options``/``as_service``)."""
    seen: dict[str, str] = {}
    todo = [(f"dask_services.{name}", f"dask_services.{name}") for name in CORE]
    bad = []
    while todo:
        module, via = todo.pop()
        if module in seen:
            continue
        seen[module] = via
        path = ROOT / Path(*module.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if not path.exists():
            continue  # a name imported from a module, not a module
        for imported, _, top in _imports(path):
            if not imported.startswith("dask_services") or not top:
                continue
            if _is_extension(imported):
                bad.append(f"{via} -> {module} -> {imported}")
            elif imported != "dask_services":
                todo.append((imported, via))
    assert not bad, bad


def _itertools_objects_in(obj: object) -> list[str]:
    """The itertools objects (counters, cycles...) that pickling ``obj`` meets."""
    import io
    import pickle

    found: list[str] = []

    class Finder(pickle.Pickler):
        def reducer_override(self, value):
            if type(value).__module__ == "itertools":
                found.append(repr(value))
            return NotImplemented

    Finder(io.BytesIO()).dump(obj)
    return found


def test_what_travels_pickled_holds_no_itertools_object():
    """Plugins go pickled from the client to the scheduler and the workers, routers with
    the handles of replicated services; itertools objects stop pickling in Python 3.14
    (3.12 and 3.13 warn, which failed the README's examples run with warnings as
    errors)."""
    from dask_services._plugins import scheduler_plugins
    from dask_services.replicated import _routing
    from dask_services.replicated._worker import ReplicaWorker
    from dask_services.worker import ServiceWorkerPlugin

    router_classes = [cls for cls in vars(_routing).values() if isinstance(cls, type)
                      and cls.__module__ == _routing.__name__ and hasattr(cls, "choose")
                      and cls is not _routing.Router]
    assert len(router_classes) >= 3
    travelling = [*scheduler_plugins(), ServiceWorkerPlugin(), ReplicaWorker(),
                  *(cls() for cls in router_classes)]
    for obj in travelling:
        assert _itertools_objects_in(obj) == [], type(obj).__name__
