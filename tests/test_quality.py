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
