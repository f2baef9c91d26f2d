"""dask's own shuffle, merge and rechunk test suites, run with the ``service`` methods.

Runs the test modules of the installed dask

* ``dask/dataframe/tests/test_shuffle.py``  (``shuffle``)
* ``dask/dataframe/tests/test_multi.py``    (``multi``: merges and joins)
* ``dask/array/tests/test_rechunk.py``      (``rechunk``)

in each of four configurations, method (``tasks``, ``service``) x scheduler (``sync``,
``distributed``), one pytest process per configuration and module, and prints, for each
module and scheduler, the tests that fail or error with ``service`` but pass with
``tasks``::

    python benchmarks/dask_suites.py                      # everything (an hour or more)
    python benchmarks/dask_suites.py --modules rechunk    # a subset of the modules
    python benchmarks/dask_suites.py -k "merge and not empty" --schedulers sync

This file is also the pytest plugin of those runs (``-p benchmarks.dask_suites``), which

* sets ``dataframe.shuffle.method`` and ``array.rechunk.method`` to the method of the run
  for the whole session;
* makes dask's ``shuffle_method`` fixture (parametrized ``["disk", "tasks"]``, used by most
  shuffle and merge tests, which pass it explicitly as ``shuffle_method=...``) give the
  method of the run where it would give ``"tasks"``: otherwise those tests would never
  reach the service.  Test ids keep their ``-tasks`` suffix, so the runs line up;
* for ``distributed``, starts a ``LocalCluster`` (2 worker processes x 1 thread) and a
  ``Client`` that is the default scheduler for the session, and makes the default
  ``scheduler`` of ``dask.dataframe.utils.assert_eq`` and ``dask.array.utils.assert_eq``
  ``None`` (the client) instead of ``"sync"``: most of these tests compute through
  ``assert_eq``, which would otherwise never touch the cluster.

Tests dask marks ``slow`` are skipped unless ``--runslow`` is given, as in dask's own CI
(its root ``conftest.py``, which is not installed, skips them unless asked).  Every run
uses ``-p no:cacheprovider``, ``-q``, pytest-timeout (``--timeout``, 120 s per
test by default) and a junit xml report, from which per-test outcomes are read
(skips and xfails count as passing; an xpass is a pass).

Measured: ``rechunk`` 18 min for its four runs on 2 busy cores; ``shuffle`` and ``multi``
under sync 17 min for their four runs; under distributed, on 2 quiet cores with
``--baseline-of-failures``, 20 min for both modules (shuffle with service 523 s, multi 308
s, then tasks on shuffle's 4 failures 371 s).

Method-specific tests that remain: none found.  With ``service``, no test of the three
modules fails that passes with ``tasks``, under sync or distributed.  Under distributed,
4 shuffle tests fail with both methods (``test_set_index_sorts``,
``test_set_index_empty_partition`` and ``test_empty_partitions`` run past the 120 s
timeout, ``test_disk_shuffle_with_unknown_compression`` expects an ImportError that the
distributed scheduler does not raise).  Not run: the ``slow`` tests.

The other modules (``MORE_MODULES``, by name with ``--modules``), under sync, where each
test builds its own cluster if it wants one: no ``service``-only failure in ``groupby``
(2,234 tests), ``merge_index``, ``categorical``, ``expr_shuffle``, ``expr_groupby``,
``reshape``, ``overlap``, ``gufunc``, ``fft``, ``linalg``, ``routines``, ``reductions``
and ``array_core`` (1,254 service rechunks in ``routines``, 968 in ``linalg``).  They found
four differences, now fixed: a datetime index's frequency lost by the shuffle (groupby's
``shift(freq=...)``), ``broadcast=True`` ignored by merges (dask-expr's merge tests), an
asynchronous client not installing (``gen_cluster`` tests), and masked arrays refused
where the setting, not the caller, chose ``service`` (11 masked-array tests; masked arrays
are rechunked by the service since, and ``masked``, 139 tests, passes whole under sync and
distributed, ``test_mixed_random``'s masked chunks behind a numpy meta included).  Under
distributed as well (2 worker processes, one session cluster per module and method, 8
minutes for the five): ``expr_shuffle``, ``merge_index``, ``categorical``, ``reshape`` and
``overlap``, 564 tests, no ``service``-only failure (the same 28 of ``expr_shuffle``'s fail with
both methods under distributed, not read one by one).  Since the rechunk owns its outputs
in boxes where every output needs many inputs (``design/array-rechunk.md``): ``rechunk``
and ``masked`` under sync and distributed, ``routines`` and ``reshape`` under sync, no
``service``-only failure (``--baseline-of-failures``, 2.5 minutes for those runs).  What
remains, and why: ``expr_merge`` 1
(``test_merge_combine_similar_intermediate_projections`` looks for the projection that
drops ``_partitions`` above the shuffle, a step the service shuffle takes itself);
``dataframe`` 1 (``test_deterministic_apply_concat_apply_names`` sorts a graph's keys,
which mixes the service task's string key with tuples, as p2p's barrier does);
``expr_distributed`` 3 (``test_respect_context_shuffle`` checks the method chosen when
the collection was built, which this plugin's session-wide setting changes for every
method but ``tasks``).  Under distributed, ``gen_cluster`` modules (``expr_distributed``)
cannot run (their leak check counts this session's own cluster), and
``--baseline-of-failures`` runs the failures alone, which hides failures that depend on
the tests before them (``linalg``'s tsqr tests reuse one array name): compare full runs
there.  A pytest process that crashes (``test_memmap`` under distributed, with either
method) leaves its tests "not run".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

METHODS = ("tasks", "service")
SCHEDULERS = ("sync", "distributed")
MODULES = {
    "shuffle": "dataframe/tests/test_shuffle.py",
    "multi": "dataframe/tests/test_multi.py",
    "rechunk": "array/tests/test_rechunk.py",
}
# modules whose operations shuffle or rechunk on the way (groupby with ``split_out``,
# merges on index and columns, reshapes, overlaps, ...): run with ``--modules`` by name
MORE_MODULES = {
    "groupby": "dataframe/tests/test_groupby.py",
    "merge_index": "dataframe/tests/test_merge_column_and_index.py",
    "categorical": "dataframe/tests/test_categorical.py",
    "dataframe": "dataframe/tests/test_dataframe.py",
    "expr_shuffle": "dataframe/dask_expr/tests/test_shuffle.py",
    "expr_merge": "dataframe/dask_expr/tests/test_merge.py",
    "expr_groupby": "dataframe/dask_expr/tests/test_groupby.py",
    "expr_distributed": "dataframe/dask_expr/tests/test_distributed.py",
    "array_core": "array/tests/test_array_core.py",
    "reshape": "array/tests/test_reshape.py",
    "overlap": "array/tests/test_overlap.py",
    "gufunc": "array/tests/test_gufunc.py",
    "reductions": "array/tests/test_reductions.py",
    "linalg": "array/tests/test_linalg.py",
    "fft": "array/tests/test_fft.py",
    "masked": "array/tests/test_masked.py",
    "routines": "array/tests/test_routines.py",
}
ALL_MODULES = {**MODULES, **MORE_MODULES}
PLUGIN = "benchmarks.dask_suites"

# ---------------------------------------------------------------------------------------
# the pytest plugin


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("dask-suites")
    group.addoption("--suite-method", default="tasks", choices=METHODS,
                    help="shuffle and rechunk method of the session")
    group.addoption("--suite-scheduler", default="sync", choices=SCHEDULERS,
                    help="default scheduler of the session")


_session: dict[str, Any] = {}


def pytest_configure(config: Any) -> None:
    if not hasattr(config.option, "suite_method"):
        return
    import dask

    import dask_services  # noqa: F401  (registers the "service" methods)

    method = config.option.suite_method
    _session["method"] = method
    dask.config.set({"dataframe.shuffle.method": method, "array.rechunk.method": method})
    if config.option.suite_scheduler == "distributed":
        import dask.array.utils
        import dask.dataframe.utils
        from distributed import Client, LocalCluster

        cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                               dashboard_address=None)
        client = Client(cluster, set_as_default=True)
        _session.update(cluster=cluster, client=client)
        for function in (dask.dataframe.utils.assert_eq, dask.array.utils.assert_eq):
            _default_scheduler_none(function)


def _default_scheduler_none(function: Any) -> None:
    """Make the default of ``function``'s ``scheduler`` argument ``None``."""
    import inspect

    names = [p.name for p in inspect.signature(function).parameters.values()
             if p.default is not inspect.Parameter.empty
             and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    defaults = list(function.__defaults__)
    defaults[names.index("scheduler")] = None
    function.__defaults__ = tuple(defaults)


def pytest_unconfigure(config: Any) -> None:
    client, cluster = _session.pop("client", None), _session.pop("cluster", None)
    if client is not None:
        client.close()
        cluster.close()


def pytest_collection_modifyitems(session: Any, config: Any, items: list) -> None:
    """dask's ``shuffle_method`` fixture gives the session's method instead of ``tasks``."""
    method = _session.get("method")
    if method is None or method == "tasks":
        return
    seen = set()
    for item in items:
        for defs in item._fixtureinfo.name2fixturedefs.values():
            for fixturedef in defs:
                if fixturedef.argname == "shuffle_method" and id(fixturedef) not in seen:
                    seen.add(id(fixturedef))
                    fixturedef.func = _swap_tasks(fixturedef.func, method)


def _swap_tasks(func: Any, method: str) -> Any:
    import contextlib
    import functools
    import inspect

    import dask

    @functools.wraps(func)
    def fixture(request: Any) -> Any:
        if getattr(request, "param", None) != "tasks":
            # dask's fixture yields; a test parametrizing ``shuffle_method`` directly gets
            # pytest's stand-in, which returns its parameter
            if inspect.isgeneratorfunction(func):
                yield from func(request)
            else:
                yield func(request)
            return
        with contextlib.ExitStack() as stack:
            stack.enter_context(dask.config.set({"dataframe.shuffle.method": method}))
            yield method

    return fixture


# ---------------------------------------------------------------------------------------
# the script


def dask_dir() -> Path:
    import dask

    return Path(dask.__file__).parent


def run(module: str, method: str, scheduler: str, args: argparse.Namespace,
        workdir: Path, only: list[str] | None = None) -> tuple[dict[str, str], float]:
    """One pytest process; returns ``{test id: outcome}`` and the wall time.

    ``only``: test ids (as :func:`outcomes` names them) to run instead of the module.
    """
    xml = workdir / f"{module}-{method}-{scheduler}.xml"
    ini = workdir / "pytest.ini"
    ini.write_text("[pytest]\n")
    cmd = [
        sys.executable, "-m", "pytest", "-c", str(ini), "--rootdir", str(dask_dir()),
        "-p", "no:cacheprovider", "-p", PLUGIN, "-q", "--no-header",
        f"--suite-method={method}", f"--suite-scheduler={scheduler}",
        f"--timeout={args.timeout}", f"--junitxml={xml}",
    ]
    path = str(dask_dir() / ALL_MODULES[module])
    cmd += [_node_id(path, test) for test in only] if only else [path]
    if args.k and not only:
        cmd += ["-k", args.k]
    if not args.runslow:
        cmd += ["-m", "not slow"]
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    log = workdir / f"{module}-{method}-{scheduler}.log"
    start = time.perf_counter()
    with log.open("w") as out:
        subprocess.run(cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if not xml.exists():  # the process crashed (a test's segfault): its tests not run
        print(f"pytest wrote no report ({' '.join(cmd)}); see {log}", flush=True)
        return {}, seconds
    return outcomes(xml), seconds


def _node_id(path: str, test: str) -> str:
    """pytest's node id of a test id of :func:`outcomes` (``module::name`` or
    ``Class::name``) in the test file ``path``."""
    owner, name = test.split("::", 1)
    return f"{path}::{name}" if owner == Path(path).stem else f"{path}::{owner}::{name}"


def outcomes(xml: Path) -> dict[str, str]:
    """``{test id: "passed" | "failed" | "error" | "skipped"}`` from a junit xml report."""
    result: dict[str, str] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                # an error in teardown after a failure: the failure counts
                outcome = "failed" if outcome == "failed" else child.tag.replace(
                    "failure", "failed")
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "skipped"
        result[name] = outcome
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", default=",".join(MODULES),
                        help="comma-separated modules, by default "
                             f"{', '.join(MODULES)}; also {', '.join(MORE_MODULES)}")
    parser.add_argument("--schedulers", default=",".join(SCHEDULERS),
                        help="comma-separated subset of sync, distributed")
    parser.add_argument("-k", default=None, help="pytest -k expression for every run")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test")
    parser.add_argument("--runslow", action="store_true",
                        help="also run the tests dask marks slow (dask's CI skips them "
                             "unless asked; in test_multi they take most of the time)")
    parser.add_argument("--baseline-of-failures", action="store_true",
                        help="run service first and tasks only on the tests that fail with "
                             "service (the comparison is the same, in about half the time)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the reports and logs (their directory is printed)")
    args = parser.parse_args(argv)
    modules = [m.strip() for m in args.modules.split(",") if m.strip()]
    schedulers = [s.strip() for s in args.schedulers.split(",") if s.strip()]
    for m in modules:
        if m not in ALL_MODULES:
            parser.error(f"unknown module {m!r}; choose from {', '.join(ALL_MODULES)}")
    for s in schedulers:
        if s not in SCHEDULERS:
            parser.error(f"unknown scheduler {s!r}; choose from {', '.join(SCHEDULERS)}")

    workdir = Path(tempfile.mkdtemp(prefix="dask-suites-"))
    start = time.perf_counter()
    rows = []
    regressions: list[tuple[str, str, str, str]] = []
    for module in modules:
        for scheduler in schedulers:
            res = {}
            for method in reversed(METHODS) if args.baseline_of_failures else METHODS:
                only = None
                if args.baseline_of_failures and method == "tasks":
                    only = [t for t, o in res["service"][0].items()
                            if o in ("failed", "error")]
                    if not only:
                        res[method] = ({t: "not run" for t in res["service"][0]}, 0.0)
                        continue
                res[method] = run(module, method, scheduler, args, workdir, only)
                counts = _count(res[method][0])
                print(f"{module:8} {scheduler:12} {method:8} {res[method][1]:7.1f} s  "
                      + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())),
                      flush=True)
            tasks, service = res["tasks"][0], res["service"][0]
            bad = sorted(t for t, o in service.items()
                         if o in ("failed", "error") and tasks.get(t) in ("passed", "skipped"))
            missing = sorted(set(tasks) - set(service))
            rows.append((module, scheduler, len(service), _failing(tasks), _failing(service),
                         len(bad), res["tasks"][1], res["service"][1]))
            regressions += [(module, scheduler, t, service[t]) for t in bad]
            regressions += [(module, scheduler, t, "not run") for t in missing]

    print()
    print("| module | scheduler | tests | fail with tasks | fail with service "
          "| service-only failures | tasks s | service s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for module, scheduler, n, ft, fs, nbad, st, ss in rows:
        print(f"| {module} | {scheduler} | {n} | {ft} | {fs} | {nbad} | {st:.0f} | {ss:.0f} |")
    print()
    if regressions:
        print("Fail or error with service, pass with tasks:")
        for module, scheduler, test, outcome in regressions:
            print(f"  {module} [{scheduler}] {test}: {outcome}")
    else:
        print("No test fails with service that passes with tasks.")
    print(f"\nwall time {time.perf_counter() - start:.0f} s; reports and logs in {workdir}"
          if args.keep else f"\nwall time {time.perf_counter() - start:.0f} s")
    if not args.keep:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if regressions else 0


def _count(outcome: dict[str, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in outcome.values():
        counts[o] = counts.get(o, 0) + 1
    return counts


def _failing(outcome: dict[str, str]) -> int:
    return sum(o in ("failed", "error") for o in outcome.values())


if __name__ == "__main__":
    sys.exit(main())
