"""Replicated services: per-call latency against Dask actors and tasks, and throughput.

    dask-services bench replicated [--calls 1000] [--workers 2] [--json]

Latency: ``svc.echo.route(x).result()``, a Dask actor's method call
(``actor.echo(x).result()``, the actor made with ``client.submit(Echo, actor=True)``) and
``client.submit(echo, x).result()`` (plus ``route`` to a sync endpoint, which runs in a
thread like the actor's method), one call at a time from the client, in rotating order
so that drift hits every method alike; p50 and p99 over ``calls`` calls each, after a
warm-up.  Throughput: calls per second with 1, 2 and 4 replicas of an endpoint that takes
5 ms (``await asyncio.sleep``), one call at a time per replica (``max_concurrency=1``), with
64 calls in flight from the client.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from typing import Any

import numpy as np

import dask_services
from benchmarks.common import progress

SERVICE_TIME = 0.005
BATCH_TIME = 0.002  # a vectorized model call: this long whatever the batch's size


class Echo(dask_services.Service):
    """Returns its argument (latency) or waits 5 ms first (throughput)."""

    @dask_services.endpoint
    async def echo(self, x: Any) -> Any:
        return x

    @dask_services.endpoint
    def echo_sync(self, x: Any) -> Any:
        return x

    def __init__(self) -> None:
        self.spent: list[float] = []  # seconds each `work` call took inside the endpoint

    @dask_services.endpoint
    async def work(self, x: Any) -> Any:
        start = time.perf_counter()
        await asyncio.sleep(SERVICE_TIME)
        self.spent.append(time.perf_counter() - start)
        return x

    @dask_services.endpoint
    def work_sync(self, x: Any) -> Any:
        start = time.perf_counter()
        time.sleep(SERVICE_TIME)
        self.spent.append(time.perf_counter() - start)
        return x

    @dask_services.endpoint
    def take_spent(self) -> list[float]:
        spent, self.spent = self.spent, []
        return spent


def _vectorized(xs: list[float]) -> list[float]:
    """numpy over the whole batch, then the rest of a fixed ``BATCH_TIME``."""
    start = time.perf_counter()
    out = np.sqrt(np.asarray(xs, dtype=float)).tolist()
    left = BATCH_TIME - (time.perf_counter() - start)
    if left > 0:
        time.sleep(left)
    return out


class Model(dask_services.Service):
    """A vectorized endpoint, batched and not."""

    @dask_services.endpoint(batch_size=64, batch_wait="2ms")
    def predict_batched(self, xs: list[float]) -> list[float]:
        return _vectorized(xs)

    @dask_services.endpoint
    def predict(self, x: float) -> float:
        return _vectorized([x])[0]


class EchoActor:
    """The same endpoint as a Dask actor."""

    def echo(self, x: Any) -> Any:
        return x


def echo(x: Any) -> Any:
    """The same call as a task."""
    return x


def _quantiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"p50_ms": statistics.median(ordered) * 1e3, "p99_ms": p99 * 1e3,
            "calls": len(ordered)}


def latency(client: Any, calls: int, show_progress: bool = True) -> dict[str, dict]:
    """p50/p99 round trip of one call for route, an actor call and a task."""
    svc = Echo.options(replicas=1).as_service(client=client)
    actor_future = client.submit(EchoActor, actor=True)
    actor = actor_future.result()
    counter = iter(range(10**9))
    methods = {
        "route": lambda: svc.echo.route(next(counter)).result(),
        "route_sync": lambda: svc.echo_sync.route(next(counter)).result(),
        "actor": lambda: actor.echo(next(counter)).result(),
        "submit": lambda: client.submit(echo, next(counter), pure=False).result(),
    }
    times: dict[str, list[float]] = {m: [] for m in methods}
    try:
        for fn in methods.values():  # warm-up: connections, imports, caches
            for _ in range(50):
                fn()
        rounds = 10
        per_round = max(1, calls // rounds)
        for r in range(rounds):
            names = list(methods)
            names = names[r % len(names):] + names[:r % len(names)]
            for name in names:
                fn = methods[name]
                for _ in range(per_round):
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            progress(r + 1, rounds, "latency", show_progress)
    finally:
        svc.shutdown()
        actor_future.release()
    return {name: _quantiles(t) for name, t in times.items()}


def throughput(client: Any, replicas: int, calls: int, window: int = 64,
               method: str = "work") -> dict[str, float]:
    """Calls per second with ``replicas`` replicas and ``window`` calls in flight.

    Besides the ideal (``replicas / SERVICE_TIME``), the time the endpoint itself took
    (measured inside it) gives the ideal for that time: ``await asyncio.sleep(0.005)`` on a
    worker's event loop takes longer than 5 ms (the loop wakes in whole milliseconds), which
    no framework can give back.  What is left per call is the framework's overhead."""
    svc = Echo.options(replicas=replicas, max_concurrency=1, max_queued=10_000).as_service(
        client=client)

    async def run(n: int) -> float:
        pending: set = set()
        start = time.perf_counter()
        for i in range(n):
            if len(pending) >= window:
                done, pending = await asyncio.wait(pending,
                                                   return_when=asyncio.FIRST_COMPLETED)
                for d in done:
                    d.result()
            pending.add(asyncio.ensure_future(svc._call(method, (i,), {})))
        for d in await asyncio.gather(*pending):
            assert d is not None
        return time.perf_counter() - start

    try:
        client.sync(run, min(200, calls))  # warm-up
        svc.take_spent.fanout().result()
        workers_cpu = client.run(time.process_time)
        cpu = time.process_time()
        seconds = client.sync(run, calls)
        cpu = time.process_time() - cpu
        workers_cpu = sum(t - workers_cpu[w] for w, t in client.run(time.process_time).items())
        spent = [t for per_replica in svc.take_spent.fanout().result() for t in per_replica]
    finally:
        svc.shutdown()
    endpoint_s = statistics.mean(spent)
    per_call_s = replicas * seconds / calls  # what one call occupies its replica
    # CPU per call does not depend on how busy the machine is, unlike calls per second
    return {"replicas": replicas, "calls": calls, "seconds": seconds, "method": method,
            "calls_per_s": calls / seconds,
            "ideal_calls_per_s": replicas / SERVICE_TIME,
            "endpoint_ms": endpoint_s * 1e3,
            "ideal_for_endpoint_calls_per_s": replicas / endpoint_s,
            "overhead_ms_per_call": (per_call_s - endpoint_s) * 1e3,
            "client_cpu_ms_per_call": cpu / calls * 1e3,
            "workers_cpu_ms_per_call": workers_cpu / calls * 1e3}


def batching(client: Any, calls: int, callers: int = 64) -> dict[str, Any]:
    """Calls per second of a vectorized endpoint (``BATCH_TIME`` per call, whatever the
    batch's size) on one replica, from ``callers`` concurrent callers, with and without
    batching."""
    svc = Model.options(replicas=1, max_concurrency=1, max_queued=10_000).as_service(
        client=client)

    async def run(method: str, n: int) -> float:
        counter = iter(range(n))

        async def caller() -> None:
            for i in counter:
                assert await svc._call(method, (float(i),), {}) >= 0

        start = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(callers)))
        return time.perf_counter() - start

    result: dict[str, Any] = {"callers": callers, "batch_ms": BATCH_TIME * 1e3}
    try:
        for method, label in (("predict", "unbatched"), ("predict_batched", "batched")):
            client.sync(run, method, min(calls, 200))  # warm-up
            n = calls if label == "batched" else max(callers * 2, calls // 10)
            result[label] = {"calls": n, "calls_per_s": n / client.sync(run, method, n)}
    finally:
        svc.shutdown()
    result["speedup"] = (result["batched"]["calls_per_s"]
                         / result["unbatched"]["calls_per_s"])
    return result


def run(client: Any, calls: int = 1000, replicas: tuple[int, ...] = (1, 2, 4),
        show_progress: bool = True) -> dict[str, Any]:
    """Latency of the three kinds of call, then throughput for each replica count."""
    result: dict[str, Any] = {"latency": latency(client, calls, show_progress)}
    actor = result["latency"]["actor"]["p50_ms"]
    result["route_p50_over_actor_p50"] = result["latency"]["route"]["p50_ms"] / actor
    result["route_sync_p50_over_actor_p50"] = result["latency"]["route_sync"]["p50_ms"] / actor
    result["throughput"] = []
    runs = [(n, "work") for n in replicas] + [(max(replicas), "work_sync")]
    for i, (n, method) in enumerate(runs, 1):
        result["throughput"].append(throughput(client, n, max(calls, 400), method=method))
        progress(i, len(runs), "throughput", show_progress)
    result["batching"] = batching(client, max(calls, 2000))
    result["load_average"] = os.getloadavg()
    return result


def report(result: dict[str, Any]) -> str:
    """The result as two markdown tables."""
    lat = result["latency"]
    actor = lat["actor"]["p50_ms"]
    lines = ["call | p50 ms | p99 ms | p50 / actor p50", "--- | --- | --- | ---"]
    labels = {"route": "svc.echo.route(x).result() (async endpoint)",
              "route_sync": "svc.echo_sync.route(x).result() (sync endpoint, thread)",
              "actor": "actor.echo(x).result() (sync method)",
              "submit": "client.submit(echo, x).result()"}
    for name, label in labels.items():
        q = lat[name]
        lines.append(f"{label} | {q['p50_ms']:.3f} | {q['p99_ms']:.3f} | "
                     f"{q['p50_ms'] / actor:.2f}")
    lines += ["", f"replicas | endpoint ({SERVICE_TIME * 1e3:.0f} ms, max_concurrency=1) | "
                  "calls/s | ideal calls/s | x ideal | endpoint's own ms | ideal for that | "
                  "x that | overhead ms/call | client CPU ms/call | workers' CPU ms/call",
              "--- | --- | --- | --- | --- | --- | --- | --- | --- | --- | ---"]
    kinds = {"work": "async (asyncio.sleep)", "work_sync": "sync (time.sleep, thread)"}
    for row in result["throughput"]:
        ideal, own = row["ideal_calls_per_s"], row["ideal_for_endpoint_calls_per_s"]
        lines.append(f"{row['replicas']} | {kinds[row.get('method', 'work')]} | "
                     f"{row['calls_per_s']:.0f} | {ideal:.0f} | "
                     f"{row['calls_per_s'] / ideal:.2f} | {row['endpoint_ms']:.2f} | "
                     f"{own:.0f} | {row['calls_per_s'] / own:.2f} | "
                     f"{row['overhead_ms_per_call']:.2f} | "
                     f"{row['client_cpu_ms_per_call']:.3f} | "
                     f"{row['workers_cpu_ms_per_call']:.3f}")
    b = result["batching"]
    lines += ["", f"vectorized endpoint ({b['batch_ms']:.0f} ms a call or a batch), 1 replica, "
                  f"{b['callers']} callers | calls/s", "--- | ---",
              f"without batching | {b['unbatched']['calls_per_s']:.0f}",
              f"@endpoint(batch_size=64, batch_wait='2ms') | {b['batched']['calls_per_s']:.0f}",
              f"speedup | {b['speedup']:.1f}x", "",
              "load average (1, 5, 15 min): " + ", ".join(
                  f"{x:.1f}" for x in result["load_average"])]
    return "\n".join(lines)
