"""xarray workloads with the ``service`` rechunk, each result compared with ``tasks``.

Needs ``xarray`` and ``zarr`` (not dependencies of dask-services; ``pip install xarray
zarr``).  On a 2-worker LocalCluster, with ``array.rechunk.method`` set to ``service`` and
then to ``tasks``, each case computes an everyday xarray step on a 730 x 60 x 80 float32
dataset of two variables (rechunks to time series, quantiles, resampling, groupby
climatologies and anomalies, rolling means, transposes, coarsening, stacking, selections
after a rechunk, polyfit, padding, a zarr round trip) and checks the two results with
``xarray.testing.assert_allclose``::

    python benchmarks/xarray_workloads.py

Measured with xarray 2026.9 and zarr 3.1: every case equal (``interp`` needs scipy).
"""

from __future__ import annotations

import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import dask
import numpy as np
import pandas as pd

import dask_services  # noqa: F401  (the "service" rechunk method)


def dataset() -> Any:
    import xarray as xr

    time = pd.date_range("2000-01-01", periods=730, freq="D")
    rng = np.random.default_rng(0)
    t = xr.DataArray(rng.normal(size=(730, 60, 80)).astype("f4"), dims=("time", "y", "x"),
                     coords={"time": time, "y": np.arange(60), "x": np.arange(80)}, name="t")
    return xr.Dataset({"t": t, "p": t * 2 + 1}).chunk({"time": 30, "y": 60, "x": 80})


CASES: dict[str, Callable[[Any], Any]] = {
    "time series then mean": lambda ds: ds.chunk({"time": -1, "y": 10, "x": 10}).mean("time"),
    "quantile over time": lambda ds: ds.t.chunk({"time": -1, "y": 20, "x": 20}).quantile(
        0.9, dim="time"),
    "monthly resample": lambda ds: ds.resample(time="MS").mean(),
    "monthly climatology": lambda ds: ds.groupby("time.month").mean(),
    "anomalies": lambda ds: ds.groupby("time.month") - ds.groupby("time.month").mean(),
    "rolling 7 days": lambda ds: ds.t.rolling(time=7, center=True).mean(),
    "transpose then chunk": lambda ds: ds.t.transpose("x", "y", "time").chunk(
        {"x": 8, "y": -1, "time": 365}).sum("time"),
    "coarsen": lambda ds: ds.coarsen(y=3, x=4, boundary="trim").mean(),
    "diff and cumsum": lambda ds: ds.t.chunk({"time": 100}).diff("time").cumsum("time"),
    "stack": lambda ds: ds.t.stack(point=("y", "x")).chunk({"point": 400, "time": -1}).mean(
        "time"),
    "isel after rechunk": lambda ds: ds.t.chunk({"time": 73, "y": 7, "x": 9}).isel(
        time=slice(5, 40), y=slice(3, 30)),
    "polyfit": lambda ds: ds.t.chunk({"time": -1, "y": 15, "x": 20}).polyfit(
        "time", 1).polyfit_coefficients,
    "where and fillna": lambda ds: ds.t.where(ds.t > 0).chunk({"time": 365}).fillna(0).max(
        "time"),
    "pad": lambda ds: ds.t.pad(time=(3, 3), mode="edge").chunk({"time": 100}).sum(("y", "x")),
    "argmax": lambda ds: ds.t.chunk({"time": -1, "y": 30}).argmax("time"),
    "zarr round trip": lambda ds: _zarr_round_trip(ds.chunk({"time": 365, "y": 20, "x": 20})),
}


def _zarr_round_trip(ds: Any) -> Any:
    import xarray as xr

    path = tempfile.mkdtemp(prefix="xarray-workloads-")
    ds.to_zarr(path, mode="w")
    return xr.open_zarr(path)


def main() -> int:
    import xarray as xr
    from distributed import Client, LocalCluster

    failed = 0
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster, \
            Client(cluster):
        ds = dataset()
        for name, case in CASES.items():
            try:
                results = []
                for method in ("service", "tasks"):
                    with dask.config.set({"array.rechunk.method": method}):
                        results.append(case(ds).compute())
                xr.testing.assert_allclose(*results)
                print(f"equal      {name}", flush=True)
            except Exception:  # noqa: BLE001 - every case is reported
                failed += 1
                print(f"DIFFERENT  {name}", flush=True)
                traceback.print_exc(limit=4)
    print(f"{failed} of {len(CASES)} cases differ")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
