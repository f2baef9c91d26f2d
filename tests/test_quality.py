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
