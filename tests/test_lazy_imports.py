"""``import dask_services`` imports neither dask.dataframe (pandas, pyarrow) nor
dask.array: the ``"service"`` shuffle and rechunk methods are registered when those are
imported, in any order, on the client, the workers and the scheduler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.timeout(120)


def run_python(code: str) -> str:
    """The last line ``code`` prints, run in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_importing_dask_services_imports_no_pandas_and_registers_with_dask_dataframe():
    out = run_python("""
        import json, sys
        import dask_services
        before = sorted(m for m in ("pandas", "pyarrow", "dask.dataframe",
                                    "dask_services.dataframe") if m in sys.modules)
        import dask.dataframe as dd
        import pandas as pd
        registered = "dask_services.dataframe" in sys.modules
        df = dd.from_pandas(pd.DataFrame({"a": range(20)}), npartitions=4)
        keys = df.shuffle("a", shuffle_method="service").optimize().__dask_graph__()
        service = any("service" in str(k) for k in keys)
        print(json.dumps([before, registered, service, dask_services.dataframe.METHOD]))
    """)
    assert json.loads(out) == [[], True, True, "service"]


def test_importing_dask_services_imports_no_dask_array_and_registers_with_it():
    out = run_python("""
        import json, sys
        import dask_services
        before = sorted(m for m in ("dask.array", "dask_services.array") if m in sys.modules)
        import dask.array as da
        registered = "dask_services.array" in sys.modules
        y = da.arange(100, chunks=10).reshape(10, 10).rechunk((10, 2), method="service")
        service = any("service" in str(k) for k in y.__dask_graph__())
        total = int(y.sum().compute(scheduler="sync"))
        print(json.dumps([before, registered, service, total, dask_services.array.METHOD]))
    """)
    assert json.loads(out) == [[], True, True, 4950, "service"]


def test_the_rechunk_method_in_the_config_before_dask_array_is_imported():
    out = run_python("""
        import dask, dask_services
        with dask.config.set({"array.rechunk.method": "service"}):
            import dask.array as da
            y = da.ones((20, 20), chunks=(2, 20)).rechunk((20, 2))
            service = any("service" in str(k) for k in y.__dask_graph__())
            print(service, y.sum().compute(scheduler="sync"))
    """)
    assert out == "True 400.0"


@pytest.mark.parametrize("kind, function", [("dataframe", "shuffle"),
                                            ("array", "rechunk")])
def test_the_subpackage_is_reached_as_an_attribute_before_dask_imports_it(kind, function):
    out = run_python(f"""
        import sys
        import dask_services
        method = dask_services.{kind}.{function}  # imports it, dask.{kind} with it
        print("dask.{kind}" in sys.modules and callable(method))
    """)
    assert out == "True"


@pytest.mark.parametrize("kind", ["dataframe", "array"])
def test_dask_imported_first_is_registered_at_once(kind):
    out = run_python(f"""
        import sys
        import dask.{kind}
        import dask_services
        print("dask_services.{kind}" in sys.modules)
    """)
    assert out == "True"


def _wait_for(path: str, deadline: float) -> None:
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} was never written"
        time.sleep(0.1)  # a file another process writes: nothing to wait on but it


def test_a_scheduler_and_workers_of_their_own_run_a_service_shuffle_and_array_work(
        tmp_path):
    """The scheduler process unpickles the collection the client sends and lowers it:
    dask.dataframe is imported there then, and the method registered before it is used.
    Before any work no process holds dask.array or pandas; workers that ran array work
    only hold no pandas.  The workers preload dask_services too, which is harmless."""
    scheduler_file = str(tmp_path / "scheduler.json")
    env = {**os.environ, "DASK_DISTRIBUTED__WORKER__DAEMON": "False"}
    scheduler = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
         "--port", "0", "--no-dashboard", "--preload", "dask_services",
         "--scheduler-file", scheduler_file],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = []
    logs = [open(tmp_path / f"worker-{i}.log", "w") for i in range(2)]
    try:
        _wait_for(scheduler_file, time.monotonic() + 60)
        workers = [subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file",
             scheduler_file, "--nthreads", "1", "--no-dashboard", "--no-nanny",
             "--preload", "dask_services"],
            env=env, stdout=subprocess.DEVNULL, stderr=log)
            for log in logs]
        out = run_python(f"""
            import json, sys
            import dask.array as da
            from distributed import Client
            import dask_services
            with Client(scheduler_file={scheduler_file!r}, timeout="60s") as client:
                client.wait_for_workers(2, timeout=60)
                held = lambda: sorted(m for m in ("dask.array", "pandas") if m in sys.modules)
                idle = [*client.run(held).values(), client.run_on_scheduler(held)]
                x = da.ones((100, 100), chunks=(10, 100))
                total = x.rechunk((100, 10), method="service").sum().compute()
                lean = client.run(lambda: "pandas" in sys.modules)
                import dask.dataframe as dd
                import pandas as pd
                pdf = pd.DataFrame({{"k": range(200), "v": range(200)}})
                df = dd.from_pandas(pdf, npartitions=5)
                shuffled = df.shuffle("k", shuffle_method="service")
                parts = shuffled.map_partitions(len).compute().tolist()
                same = sorted(shuffled.compute()["k"]) == list(range(200))
                print(json.dumps([idle, total, sorted(lean.values()), sum(parts), same]))
        """)
        assert json.loads(out) == [[[], [], []], 10000.0, [False, False], 200, True]
    finally:  # the workers first, while their scheduler is there to say goodbye to
        for group in (workers, [scheduler]):
            for process in group:
                process.terminate()
            for process in group:
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=20)
        for log in logs:
            log.close()
    for i in range(2):  # the preload ran on each worker without an error
        text = (tmp_path / f"worker-{i}.log").read_text()
        assert "Import preload module: dask_services" in text, text
        assert "Failed to start preload" not in text and "Traceback" not in text, text
