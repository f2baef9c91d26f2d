"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import dask
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_readme_examples_run():
    quickstart, service = blocks()[:2]
    ns: dict = {}
    exec(compile(quickstart, "README-quickstart", "exec"), ns)
    try:
        assert ns["client"].gather(ns["futures"]) == [45, 45]
        assert dask.compute(*ns["outs"]) == (45, 45, 45)
        exec(compile(service, "README-service", "exec"), ns)
        hist = ns["dask_services"].service_task(
            ns["Histogram"], [dask.delayed([0.05, 0.15, 0.95]), dask.delayed([0.5])],
            outputs=2, bins=10,
        )
        expected = [1, 1, 0, 0, 0, 1, 0, 0, 0, 1]
        assert dask.compute(*hist) == (expected, expected)  # on the cluster
        assert dask.compute(*hist, scheduler="sync") == (expected, expected)
    finally:
        ns["client"].close()
        ns["client"].cluster.close()
