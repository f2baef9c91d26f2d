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
    found = blocks()
    quickstart = found[0]
    service = next(b for b in found if "class Histogram" in b)
    shuffle = next(b for b in found if 'shuffle_method="service"' in b)
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
        import dask.dataframe as dd
        import pandas as pd

        pdf = pd.DataFrame({"key": [3, 1, 2, 3] * 5, "x": range(20), "g": [1, 2] * 10})
        ns.update(df=dd.from_pandas(pdf, npartitions=3), left=dd.from_pandas(pdf, 2),
                  right=dd.from_pandas(pdf[["key", "g"]].rename(columns={"g": "h"}), 2),
                  f=lambda d: d.x.sum())
        exec(compile(shuffle, "README-shuffle", "exec"), ns)  # builds the graphs lazily
        expected = [1, 1, 0, 0, 0, 1, 0, 0, 0, 1]
        assert dask.compute(*hist) == (expected, expected)  # on the cluster
        assert dask.compute(*hist, scheduler="sync") == (expected, expected)
    finally:
        ns["client"].close()
        ns["client"].cluster.close()
