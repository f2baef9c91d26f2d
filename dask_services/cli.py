"""``dask-services demo``, ``dask-services bench`` and ``dask-services status``
(``_cli_status.py``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from dask_services import _cli_status


def _local_cluster(workers: int, threads: int, processes: bool, **kwargs: Any) -> Any:
    from distributed import LocalCluster

    return LocalCluster(
        n_workers=workers, threads_per_worker=threads, processes=processes,
        dashboard_address=":0", **kwargs,
    )


# Longer than any benchmark command's pauses between two graphs (see ``_bench_client``).
BENCH_TCP_TIMEOUT = "2h"


@contextlib.contextmanager
def _bench_client(args: argparse.Namespace) -> Iterator[Any]:
    """A client of a new LocalCluster for one benchmark command.

    The benchmarks replace the worker processes between runs.  On distributed 2026.8.0 the
    LocalCluster's worker-status watcher now and then misses a worker that arrives and
    leaves in quick succession; it then fails with a KeyError on the departure and raises
    it again when the cluster closes.  That error says nothing about the measurements,
    which are reported before the cluster closes, so closing tolerates it.

    The connections get a long kernel-level TCP timeout (:data:`BENCH_TCP_TIMEOUT`): on some
    Linux kernels a connection whose peer stopped reading for a moment (a multi-megabyte
    graph sent to a scheduler that shares the client's event loop, as a LocalCluster's
    does) is reset with ``ETIMEDOUT`` the next time that happens more than
    ``distributed.comm.timeouts.tcp`` later, whatever ran in between; plain
    dask.distributed shows it too (``design/architecture.md``, "Lost client connections").
    """
    import dask
    from distributed import Client

    limit = getattr(args, "memory_limit", None)
    with dask.config.set({"distributed.comm.timeouts.tcp": BENCH_TCP_TIMEOUT}):
        cluster = _local_cluster(args.workers, args.threads, True,
                                 **({"memory_limit": limit} if limit else {}))
        try:
            with Client(cluster) as client:
                yield client
        finally:
            try:
                cluster.close()
            except KeyError as exc:
                print(f"note: the local cluster's worker-status watcher failed ({exc!r}); "
                      "the figures above are unaffected", file=sys.stderr)


def show_progress(args: argparse.Namespace) -> bool:
    """Progress bars go to stderr, only when it is a terminal and ``--quiet`` is not given
    (stdout, e.g. ``--json``, is never touched)."""
    return not args.quiet and sys.stderr.isatty()


def _progress(iterable: Sequence[Any], label: str, enabled: bool) -> Any:
    """A minimal progress bar on stderr (no extra dependency)."""
    total = len(iterable)
    for i, item in enumerate(iterable, 1):
        yield item
        if enabled:
            filled = int(30 * i / total)
            print(f"\r{label} [{'#' * filled}{'.' * (30 - filled)}] {i}/{total}",
                  end="" if i < total else "\n", file=sys.stderr, flush=True)


def dashboard_hint() -> str:
    """The command that adds the dashboard's Services page to this very environment.

    ``pip install 'dask-services[dashboard]'`` only works where the package is on an index;
    installing the extra's requirements with this interpreter's pip works wherever the
    package came from (a checkout, a wheel, an index).
    """
    import importlib.metadata
    import re
    import shlex

    try:
        requires = importlib.metadata.requires("dask-services") or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    extra = re.compile(r"""extra\s*==\s*["']dashboard["']""")
    wanted = [r.split(";")[0].strip() for r in requires if extra.search(r)]
    wanted = wanted or ["bokeh>=3.1.0", "prometheus_client>=0.20"]
    return " ".join([shlex.quote(sys.executable), "-m", "pip", "install",
                     *(shlex.quote(w) for w in wanted)])


# dask's own P2P shuffle logs a WARNING when a shuffle starts and ends; the demo compares
# against it, and those lines are not what the demo shows.
QUIET_LOGGERS = ("distributed.shuffle",)


@contextlib.contextmanager
def quiet_dask_logs(client: Any) -> Iterator[None]:
    """Raise the level of :data:`QUIET_LOGGERS` to ERROR here and on the workers."""
    import logging

    def quiet(names: Sequence[str] = QUIET_LOGGERS, level: int = logging.ERROR) -> dict:
        before = {}
        for name in names:
            logger = logging.getLogger(name)
            before[name] = logger.level
            logger.setLevel(level)
        return before

    def restore(levels: dict) -> None:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)

    here = quiet()
    workers = client.run(quiet)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            for address, levels in workers.items():
                client.run(restore, levels, workers=[address])
        restore(here)  # last: in-process workers share these loggers


def demo(args: argparse.Namespace) -> int:
    import dask
    from distributed import Client

    import dask_services
    from dask_services.demo_services import Histogram
    from dask_services.examples import AllReduce, SampleSort

    print(f"Starting a LocalCluster with {args.workers} worker processes ...")
    with _local_cluster(args.workers, 1, True) as cluster, Client(cluster) as client, \
            quiet_dask_logs(client):
        dask_services.install(client)
        print(f"  dashboard: {client.dashboard_link}")
        if _has_services_page(client):
            print(f"  service runs: {client.dashboard_link.rsplit('/', 1)[0]}/services")
        else:
            print("  for the dashboard's Services page, install bokeh and prometheus_client:")
            print(f"    {dashboard_hint()}")

        def timed(label: str, fn: Callable[[], Any]) -> Any:
            start = time.perf_counter()
            result = fn()
            print(f"  {label:<48} {time.perf_counter() - start:8.3f} s")
            return result

        rng = dask.delayed(lambda seed, n: __import__("numpy").random.default_rng(seed)
                           .integers(0, 1000, n))
        chunks = [rng(seed, 10_000) for seed in range(16)]

        print("\n1. A user-defined service (dask_services.demo_services.Histogram):")
        print("   each instance bins its inputs, peers exchange counts over RPC,")
        print("   and every output is the histogram of one range of values.")
        hist = dask_services.service_task(Histogram, chunks, outputs=4, bins=10, high=1000)
        parts = timed("histogram of 160,000 values (4 outputs)", lambda: dask.compute(*hist))
        for i, part in enumerate(parts):
            print(f"     output {i}: {part}")
        total = sum(sum(p.values()) for p in parts)
        print(f"     total count: {total:,} (expected 160,000)")

        print("\n2. Built-in example services:")
        sums = dask_services.service_task(AllReduce, chunks, outputs=2, op="sum")
        s = timed("all-reduce (element-wise sum of 16 arrays)", lambda: dask.compute(*sums))
        print(f"     first elements of the sum: {s[0][:5].tolist()}")
        sorted_parts = dask_services.service_task(SampleSort, chunks[:4], outputs=4)
        # Each partition is a list; fetched as an array (distributed moves a list of Python
        # ints element by element: four lists of 10,000 take seconds to gather).
        as_array = dask.delayed(__import__("numpy").asarray)
        out = timed("sample sort of 40,000 numbers into 4 partitions",
                    lambda: dask.compute(*(as_array(p) for p in sorted_parts)))
        flat = [int(v) for p in out for v in p]
        print(f"     partition sizes: {[len(p) for p in out]}; sorted: {flat == sorted(flat)}")

        print("\n3. Without a cluster (dask's local scheduler runs the instances in-process):")
        local = timed("all-reduce with scheduler='sync'",
                      lambda: dask.compute(*sums, scheduler="sync"))
        print(f"     same result as on the cluster: {bool((local[0] == s[0]).all())}")
        print("\n4. DataFrame shuffle: shuffle_method='service' against dask's own methods")
        import dask.dataframe as dd
        import numpy as np
        import pandas as pd
        from distributed import wait

        def part(i: int, rows: int = 100_000) -> pd.DataFrame:
            rng = np.random.default_rng(i)
            keys = rng.integers(0, 10**9, rows)
            return pd.DataFrame({"key": keys, "value": rng.random(rows),
                                 "text": pd.array((keys % 9973).astype(str), dtype="str")})

        df = dd.from_map(part, range(32), meta=part(0, 0), enforce_metadata=False)
        # the input made once untimed, so that the first method timed does not pay for
        # the workers' first use of pandas and pyarrow on it
        df.map_partitions(len).sum().compute()
        rows = {}
        for method in ("service", "p2p", "tasks"):
            shuffled = df.shuffle("key", shuffle_method=method)

            def run(shuffled: Any = shuffled, method: str = method) -> None:
                persisted = client.persist(shuffled)
                wait(persisted)
                rows[method] = int(persisted.map_partitions(len).sum().compute())

            timed(f"shuffle of 3.2M rows, 32 partitions ({method})", run)
        print(f"     rows after each shuffle: {rows}")
        print("\n5. What the scheduler saw (dask_services.status(client)):")
        print("   bytes sent and received: data the instances exchanged with their peers,")
        print("   counted where it left and where it arrived")
        columns = ["service", "run_id", "state", "workers", "inputs_handed_off",
                   "outputs_produced", "bytes_sent", "bytes_received", "duration_s"]
        table = dask_services.status(client)[columns].copy()
        from dask_services.dashboard import human_bytes

        for column in ("bytes_sent", "bytes_received"):
            table[column] = table[column].map(human_bytes)
        print(table.to_string(index=False))
        print("\nDone. See README.md for writing your own service, and notebooks/ for tours.")
    return 0


def _has_services_page(client: Any) -> bool:
    """Whether the scheduler serves the dashboard's /services page (bokeh installed)."""

    def check(dask_scheduler: Any) -> bool:
        apps = getattr(getattr(dask_scheduler, "http_application", None), "applications", [])
        return any("/services" in getattr(a, "app_paths", ()) for a in apps)

    return bool(client.run_on_scheduler(check))


def bench(args: argparse.Namespace) -> int:
    import distributed
    from distributed import Client

    import dask_services
    from dask_services.examples import AllReduce

    if args.what == "shuffle":
        return bench_shuffle(args)
    if args.what == "rechunk":
        return bench_rechunk(args)
    if args.what == "replicated":
        return bench_replicated(args)
    if args.what == "queries":
        return bench_queries(args)
    results: dict[str, Any] = {"benchmark": "overhead", "workers": args.workers,
                               "repeat": args.repeat}
    participants = None
    if args.workers > 2:  # inputs on two workers, the others with nothing to do
        _benchmarks()  # before the workers start: they import its service from there
        from benchmarks import participants
    with _local_cluster(args.workers, 1, True) as cluster, Client(cluster) as client:
        dask_services.install(client)

        def one_submit() -> None:
            client.submit(int, time.perf_counter_ns()).result()

        def one_service() -> None:
            inputs = [client.submit(int, i, key=f"in-{time.perf_counter_ns()}-{i}")
                      for i in range(10)]
            distributed.wait(inputs)
            start = time.perf_counter()
            outs = dask_services.submit(AllReduce, inputs, outputs=10, client=client)
            client.gather(outs)
            return time.perf_counter() - start

        def measure(fn: Callable[[], Any], label: str) -> list[float]:
            times = []
            for _ in _progress(range(args.repeat), label, show_progress(args)):
                start = time.perf_counter()
                inner = fn()
                times.append(inner if isinstance(inner, float) else
                             time.perf_counter() - start)
            return times

        measure(one_submit, "warm-up")
        submit_times = measure(one_submit, "client.submit")
        service_times = measure(one_service, "service task")
        idle: dict[str, float] = {}
        if participants is not None:
            idle = participants.run(client, args.repeat)
    results["client_submit_median_s"] = statistics.median(submit_times)
    results["service_task_median_s"] = statistics.median(service_times)
    results["ratio"] = results["service_task_median_s"] / results["client_submit_median_s"]
    results["inputs_on_two_workers_median_s"] = idle
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"{'what':<44}{'median':>12}")
        print(f"{'client.submit(...).result() of one task':<44}"
              f"{results['client_submit_median_s'] * 1e3:>9.2f} ms")
        print(f"{'service task, 10 inputs -> 10 outputs':<44}"
              f"{results['service_task_median_s'] * 1e3:>9.2f} ms")
        for name, seconds in idle.items():
            label = f"{name} (inputs on 2)"
            print(f"{label:<44}{seconds * 1e3:>9.2f} ms")
        print(f"ratio: {results['ratio']:.1f}x  ({args.workers} workers, {args.repeat} repeats)")
    return 0


def _benchmarks() -> Any:
    """The ``benchmarks`` package of a source checkout (it is not installed)."""
    import importlib
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isdir(os.path.join(root, "benchmarks")) and root not in sys.path:
        sys.path.insert(0, root)
    try:
        return importlib.import_module("benchmarks")
    except ImportError:
        raise SystemExit(
            "the benchmarks live in the source checkout (benchmarks/); run "
            "`dask-services bench` from a clone installed with `pip install -e .`"
        ) from None


def bench_shuffle(args: argparse.Namespace) -> int:
    _benchmarks()
    from benchmarks import shuffle
    from benchmarks.common import report

    sizes = [s for s in args.sizes.split(",") if s]
    with _bench_client(args) as client:
        many = tuple(int(n) for n in str(args.partitions).split(",") if n)
        consumers = tuple(c for c in args.consumer.split(",") if c)
        results = shuffle.run(client, sizes, args.repeat,
                              npartitions=args.input_partitions,
                              methods=tuple(args.methods.split(",")),
                              show_progress=show_progress(args), fresh=not args.reuse_workers,
                              many=many, consumers=consumers, tiny=not args.no_tiny,
                              made=args.input == "made")
        print(report(results, "p2p", args.json, extra_columns=shuffle.columns(results)),
              flush=True)
    return 0


def bench_rechunk(args: argparse.Namespace) -> int:
    _benchmarks()
    from benchmarks import rechunk
    from benchmarks.common import report

    sizes = [s for s in args.sizes.split(",") if s]
    with _bench_client(args) as client:
        results = rechunk.run(client, sizes, args.local_size or None, args.repeat,
                              methods=tuple(args.methods.split(",")),
                              show_progress=show_progress(args), fresh=not args.reuse_workers,
                              chunks=args.chunks, pieces=args.pieces, masked=args.masked,
                              series_size=args.time_series or None,
                              consumers=tuple(c for c in args.consumer.split(",") if c))
        columns = ("failed", "restarts", "paused_s", "first_output_s", "tasks",
                   "update_graph_s", "order_s", "first_task_s",
                   *rechunk.per_chunk_columns(results))
        print(report(results, "p2p", args.json, extra_columns=columns), flush=True)
    return 0


def bench_queries(args: argparse.Namespace) -> int:
    _benchmarks()
    from benchmarks import queries

    names = tuple(q for q in args.queries.split(",") if q) or tuple(queries.QUERIES)
    with _bench_client(args) as client:
        results = queries.run(client, args.scale, args.repeat,
                              methods=tuple(args.methods.split(",")), queries=names,
                              show_progress=show_progress(args))
        print(queries.report(results, args.json), flush=True)
    return 0


def bench_replicated(args: argparse.Namespace) -> int:
    from distributed import Client

    _benchmarks()
    from benchmarks import replicated, replicated_scaling

    cases = set(args.cases.split(","))
    reports = []
    with _local_cluster(args.workers, args.threads, True) as cluster, Client(cluster) as client:
        result: dict[str, Any] = {}
        if "calls" in cases:
            result = replicated.run(client, calls=args.calls,
                                    show_progress=show_progress(args))
            reports.append(replicated.report(result))
        if "scaling" in cases:  # replicas of 2 ranks, and autoscaling under a load step
            scaling = replicated_scaling.run(client, calls=args.calls,
                                             show_progress=show_progress(args))
            reports.append(replicated_scaling.report(scaling))
            result["scaling"] = scaling
    print(json.dumps(result, indent=2) if args.json else "\n\n".join(reports))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dask-services",
        description="Run the dask-services demo on a local cluster or its benchmarks, or "
                    "show a running cluster's services.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="run services on a local cluster and print results")
    p_demo.add_argument("--workers", type=int, default=2,
                        help="worker processes of the local cluster (default: 2)")
    p_demo.set_defaults(func=demo)
    p_bench = sub.add_parser("bench",
                             help="benchmarks: overhead, shuffle, rechunk, queries, "
                                  "replicated")
    p_bench.add_argument("what", choices=["overhead", "shuffle", "rechunk", "queries",
                                          "replicated"])
    p_bench.add_argument("--workers", type=int, default=2)
    p_bench.add_argument("--threads", type=int, default=1, help="threads per worker")
    p_bench.add_argument("--sizes", default="0.5GB,2GB",
                         help="frame (shuffle) or all-to-all array (rechunk) sizes")
    p_bench.add_argument("--local-size", default="0.5GB",
                         help="rechunk: size of the local (100 -> 150 rows) case; '' to skip")
    p_bench.add_argument("--partitions", default="",
                         help="shuffle: the many-partition cases, comma-separated partition "
                              "counts of 200-row partitions (e.g. 100,1000,10000; default: "
                              "none)")
    p_bench.add_argument("--input-partitions", type=int, default=128,
                         help="shuffle: partitions of the sized frames (--sizes)")
    p_bench.add_argument("--input", choices=["persisted", "made"], default="persisted",
                         help="shuffle: the sized frames (--sizes) are persisted before the "
                              "timings ('persisted', the default), or made inside every "
                              "measured graph and freed as the shuffle consumes them "
                              "('made': a pipeline over data larger than memory, with "
                              "--memory-limit)")
    p_bench.add_argument("--no-tiny", action="store_true",
                         help="shuffle: skip the tiny case")
    p_bench.add_argument("--chunks", type=int, default=0,
                         help="rechunk: also the many-chunk cases, a float32 array in about "
                              "this many 100 x 100 chunks to 125 x 80 and to 2000 x 5 chunks "
                              "(e.g. 40000; default 0: skipped)")
    p_bench.add_argument("--pieces", type=int, default=0,
                         help="rechunk: also the many-pieces case, a float32 all-to-all from "
                              "this many 10-row chunks to as many 10-column chunks (pieces "
                              "of 400 bytes; e.g. 1000; default 0: skipped)")
    p_bench.add_argument("--time-series", default="",
                         help="rechunk: also the time-series case of this size, a float32 "
                              "array of 1,000 time steps on a square grid, one chunk per "
                              "step, to whole time series in 20 x 20 tiles of the grid "
                              "(e.g. 1GB; default: skipped)")
    p_bench.add_argument("--masked", action="store_true",
                         help="rechunk: every case's array masked (numpy.ma, a tenth of "
                              "its elements masked)")
    p_bench.add_argument("--consumer", default="none,sum",
                         help="rechunk: what follows each rechunk, comma-separated: 'none' "
                              "(outputs persisted), 'sum' (rechunked.sum() computed); "
                              "shuffle: 'none', 'len' (len of every partition), 'groupby' "
                              "(a groupby-sum per partition), 'merge' (instead of one "
                              "shuffle, the frame joined with itself on its key, both "
                              "sides shuffled, then len of every partition); 'sum' is "
                              "taken as 'len'")
    p_bench.add_argument("--memory-limit", default=None,
                         help="memory limit of every worker (e.g. 0.5GB; default: the "
                              "LocalCluster's share of the machine)")
    p_bench.add_argument("--scale", type=float, default=1.0,
                         help="queries: size of the generated tables (1: 2,000,000 "
                              "lineitem rows in 40 partitions)")
    p_bench.add_argument("--queries", default="",
                         help="queries: the queries to run, comma-separated (default: all)")
    p_bench.add_argument("--methods", default="service,p2p,tasks")
    p_bench.add_argument("--repeat", type=int, default=3)
    p_bench.add_argument("--calls", type=int, default=1000,
                         help="replicated: calls per latency measurement")
    p_bench.add_argument("--cases", default="calls,scaling",
                         help="replicated: 'calls' (latency, throughput, ...), 'scaling' "
                              "(2-rank replicas, autoscaling under a load step, a burst "
                              "sent at once to one autoscaled replica); comma-separated")
    p_bench.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p_bench.add_argument("--quiet", action="store_true",
                         help="no progress bar (there is none either when stderr is not a "
                              "terminal)")
    p_bench.add_argument("--reuse-workers", action="store_true",
                         help="shuffle/rechunk: keep the worker processes between runs "
                              "(faster; by default every measured run starts on restarted "
                              "workers holding only its input, so that no method's peak "
                              "memory counts heap another method left behind)")
    p_bench.set_defaults(func=bench)
    p_status = _cli_status.add_parser(sub)
    args = parser.parse_args(argv)
    problem = (_cli_status.bad_argument(args) if args.command == "status"
               else _bad_argument(args))
    if problem is None and args.command == "bench":
        problem = _not_applicable(args, _given(parser, p_bench, argv))
    if problem is not None:
        {"bench": p_bench, "demo": p_demo, "status": p_status}[args.command].error(problem)
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # what reads the output went away (`dask-services status | head -3`): stop
        # quietly, as other tools do, and keep the interpreter's last flush of stdout from
        # failing again at exit
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


METHODS = ("service", "p2p", "tasks")
CONSUMERS = {"shuffle": ("none", "len", "sum", "groupby", "merge"), "rechunk": ("none", "sum")}
CASES = ("calls", "scaling")


# The options each benchmark reads (argparse's names); any other given is refused.
_COMMON = ("workers", "repeat", "json", "quiet")
BENCH_OPTIONS = {
    "overhead": _COMMON,
    "shuffle": (*_COMMON, "threads", "sizes", "partitions", "input_partitions", "input",
                "no_tiny", "consumer", "memory_limit", "methods", "reuse_workers"),
    "rechunk": (*_COMMON, "threads", "sizes", "local_size", "chunks", "pieces",
                "time_series", "masked",
                "consumer", "memory_limit", "methods", "reuse_workers"),
    "queries": (*_COMMON, "threads", "memory_limit", "scale", "queries", "methods"),
    "replicated": ("workers", "json", "quiet", "threads", "calls", "cases"),
}


def _given(parser: argparse.ArgumentParser, sub: argparse.ArgumentParser,
           argv: Sequence[str] | None) -> set[str]:
    """The options of the subcommand parser ``sub`` given on the command line, whatever
    their values (``--scale 1`` too, though 1 is its default): ``argv`` parsed again with
    ``sub``'s defaults left out."""
    saved = [(action, action.default) for action in sub._actions]
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        return set(vars(parser.parse_args(argv)))
    finally:
        for action, default in saved:
            action.default = default


def _not_applicable(args: argparse.Namespace, given: set[str]) -> str | None:
    """An option given that the chosen benchmark does not read: it would be ignored
    without a word (``bench overhead --sizes 1GB``, ``bench rechunk --scale 1``)."""
    takes = BENCH_OPTIONS[args.what]
    ignored = [name for name in vars(args) if name in given
               and name not in ("command", "what", "func", *takes)]
    if not ignored:
        return None
    names = ", ".join("--" + name.replace("_", "-") for name in ignored)
    options = ", ".join("--" + name.replace("_", "-") for name in takes)
    return (f"{names} {'does' if len(ignored) == 1 else 'do'} not apply to bench "
            f"{args.what}, which takes {options}")


def _bad_argument(args: argparse.Namespace) -> str | None:
    """What is wrong with the command's arguments, before any cluster starts (None:
    nothing)."""
    if args.workers < 1:
        return f"--workers must be at least 1, got {args.workers}"
    if args.command != "bench":
        return None
    for name in ("threads", "repeat", "calls", "input_partitions"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    for name in ("chunks", "pieces"):
        if getattr(args, name) < 0:
            return f"--{name} must be 0 (skipped) or more, got {getattr(args, name)}"
    methods = [m for m in args.methods.split(",") if m]
    known = METHODS + (("noop",) if args.what == "shuffle" else ())  # noop: no shuffle
    if args.what in ("shuffle", "rechunk", "queries") and (
            not methods or any(m not in known for m in methods)):
        return (f"--methods takes a comma-separated list of {', '.join(known)}; got "
                f"{args.methods!r}")
    if args.what in CONSUMERS:
        consumers = [c for c in args.consumer.split(",") if c]
        if not consumers or any(c not in CONSUMERS[args.what] for c in consumers):
            return (f"--consumer of bench {args.what} takes a comma-separated list of "
                    f"{', '.join(CONSUMERS[args.what])}; got {args.consumer!r}")
        sizes = [t for t in args.sizes.split(",") if t]
        if args.what == "rechunk":
            sizes += [t for t in (args.local_size, args.time_series) if t]
        for text in sizes:
            if _size(text) is None:
                return (f"--sizes, --local-size and --time-series take sizes such as 512MB "
                        f"or 2GB (--sizes comma-separated); got {text!r}")
    if args.what == "shuffle":
        try:
            if any(int(n) < 1 for n in args.partitions.split(",") if n):
                raise ValueError
        except ValueError:
            return (f"--partitions takes comma-separated partition counts of at least 1 "
                    f"(e.g. 1000,10000); got {args.partitions!r}")
    if args.memory_limit is not None and _size(args.memory_limit) is None:
        return f"--memory-limit takes a size such as 0.5GB; got {args.memory_limit!r}"
    if args.what == "queries":
        if not (math.isfinite(args.scale) and args.scale > 0):
            return f"--scale takes a positive number (1: 2,000,000 rows); got {args.scale}"
        _benchmarks()
        from benchmarks.queries import QUERIES

        names = [q for q in args.queries.split(",") if q]
        unknown = sorted(set(names) - set(QUERIES))
        if unknown or (args.queries and not names):
            return (f"--queries takes a comma-separated list of {', '.join(QUERIES)}; "
                    f"got {args.queries!r} (e.g. --queries q3,q5)")
    if args.what == "replicated":
        cases = [c for c in args.cases.split(",") if c]
        if not cases or any(c not in CASES for c in cases):
            return (f"--cases takes a comma-separated list of {', '.join(CASES)}; got "
                    f"{args.cases!r}")
    return None


def _size(text: str) -> int | None:
    """Bytes of a size such as 512MB (as the benchmarks read it), or None if it is not
    one or is not positive."""
    from dask.utils import parse_bytes

    try:
        size = parse_bytes(text.strip())
    except (ValueError, TypeError):
        return None
    return size if size > 0 else None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
