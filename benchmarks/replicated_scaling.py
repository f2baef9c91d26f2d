"""Replicated services that scale: replicas of several ranks, and autoscaling under a
load step (part of ``dask-services bench replicated``).

Gang: the ``route`` round trip on a replica of 2 ranks (``procs_per_replica=2``: rank 0
also sends the call to rank 1 and waits for its answer) against a replica of 1 rank, one
call at a time from the client, alternating order; p50/p99 over ``calls`` calls each.

Autoscaling: :func:`autoscaling`, a step from 1 to 16 concurrent callers of a 20 ms
endpoint; how long until the p99 latency is back under 3x the endpoint's time, the
replicas added and removed, and whether any call failed.  :func:`burst`: 400 calls sent
at once to one autoscaled replica; how long until the last is answered.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import dask_services
from benchmarks.common import progress
from benchmarks.replicated import _quantiles

# ------------------------------------------------------------------ gangs


class Ranked(dask_services.Service):
    """An echo endpoint that runs on every rank of a replica."""

    @dask_services.endpoint
    async def echo(self, x: Any) -> Any:
        return x


def gang(client: Any, calls: int, show_progress: bool = True) -> dict[str, dict]:
    """p50/p99 round trip of ``route`` on a replica of 2 ranks and on one of 1 rank."""
    one = Ranked.options(procs_per_replica=1).as_service(client=client)
    two = Ranked.options(procs_per_replica=2).as_service(client=client)
    counter = iter(range(10**9))
    methods = {"1 rank": lambda: one.echo.route(next(counter)).result(),
               "2 ranks": lambda: two.echo.route(next(counter)).result()}
    times: dict[str, list[float]] = {m: [] for m in methods}
    try:
        for fn in methods.values():  # warm-up: connections, imports, caches
            for _ in range(50):
                fn()
        rounds = 10
        per_round = max(1, calls // rounds)
        for r in range(rounds):
            for name in (list(methods) if r % 2 == 0 else list(methods)[::-1]):
                fn = methods[name]
                for _ in range(per_round):
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            progress(r + 1, rounds, "gang", show_progress)
    finally:
        one.shutdown()
        two.shutdown()
    return {name: _quantiles(t) for name, t in times.items()}


# ------------------------------------------------------------------ autoscaling

STEP_SERVICE_TIME = 0.02


class Step(dask_services.Service):
    """An endpoint that takes 20 ms (``await asyncio.sleep``)."""

    @dask_services.endpoint
    async def work(self, x: Any) -> Any:
        await asyncio.sleep(STEP_SERVICE_TIME)
        return x


# A target of one call per replica: latency stays near the endpoint's time (with 2, as in
# Ray Serve's default, each call waits for about one other and p99 sits near 3x).
AUTOSCALING = {"min_replicas": 1, "max_replicas": 16, "target_ongoing_requests": 1,
               "upscale_delay": "1s", "downscale_delay": "4s"}


def autoscaling(client: Any, callers: int = 16, before: float = 3.0, during: float = 20.0,
                after: float = 25.0, window: float = 1.0,
                config: dict | None = None) -> dict[str, Any]:
    """A load step from 1 to ``callers`` concurrent callers of a 20 ms endpoint
    (``max_concurrency=1``, ``options(autoscaling=config)``) for ``during`` s, then no
    load for at most ``after`` s, until the service is back at one replica.

    Returns the time from the step until the p99 latency of the calls finishing in every
    ``window`` (sliding by a quarter of it) up to the end of the load is under 3x the
    endpoint's time, the replicas added and removed (the scheduler's
    ``replicas-autoscaled`` events, with their reasons), the calls made and failed, and a
    timeline for plots: ``samples`` (time, replicas, healthy replicas) and ``calls`` (time
    finished, latency in s), in seconds from the step."""
    config = {**AUTOSCALING, **(config or {})}
    svc = Step.options(max_concurrency=1, max_queued=10_000,
                       autoscaling=config).as_service(client=client)

    async def run() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        finished: list[tuple[float, float]] = []
        failures: list[str] = []
        samples: list[tuple[float, int, int]] = []
        load = {"callers": 1}
        stop = asyncio.Event()
        more = asyncio.Event()
        t0 = loop.time() + before  # the step

        async def caller(k: int) -> None:
            if k >= load["callers"]:
                await more.wait()  # the step
            i = 0
            while k < load["callers"] and not stop.is_set():  # until the load ends
                start = loop.time()
                try:
                    assert await svc.work.route(i) == i
                except Exception as e:  # counted: the benchmark reports failed calls
                    failures.append(f"{type(e).__name__}: {e}")
                finished.append((loop.time() - t0, loop.time() - start))
                i += 1

        async def sampler() -> None:
            while not stop.is_set():
                table = await client.scheduler.replicated_table(name=svc.name)
                rows = table["replicas"] if table else []
                samples.append((loop.time() - t0, len(rows),
                                sum(r["state"] == "healthy" for r in rows)))
                await asyncio.sleep(0.2)

        tasks = [asyncio.ensure_future(caller(k)) for k in range(callers)]
        tasks.append(asyncio.ensure_future(sampler()))
        await asyncio.sleep(before)
        load["callers"] = callers
        more.set()
        await asyncio.sleep(during)
        load["callers"] = 0
        deadline = loop.time() + after
        while loop.time() < deadline and not (samples[-1][1] == 1
                                              and samples[-1][0] > during):
            await asyncio.sleep(0.2)
        stop.set()
        await asyncio.gather(*tasks)
        return {"calls": finished, "failures": failures, "samples": samples}

    try:
        raw = client.sync(run)
        events = [e for _, e in client.get_events("dask_services")
                  if e.get("action") == "replicas-autoscaled"
                  and e.get("service") == svc.name]
    finally:
        svc.shutdown()
    recovered = recovered_after(raw["calls"], during, window, 3 * STEP_SERVICE_TIME)
    return {
        "callers": callers, "service_ms": STEP_SERVICE_TIME * 1e3, "config": config,
        "p99_back_under_3x_after_s": recovered,
        "replicas_max": max((n for _, n, _ in raw["samples"]), default=0),
        "replicas_end": raw["samples"][-1][1] if raw["samples"] else 0,
        "added": sum(max(0, e["to"] - e["from"]) for e in events),
        "removed": sum(max(0, e["from"] - e["to"]) for e in events),
        "decisions": [f"{e['from']} -> {e['to']}: {e['reason']}" for e in events],
        "calls": len(raw["calls"]), "failed": len(raw["failures"]),
        "failures": raw["failures"][:5],
        "timeline": {"samples": raw["samples"], "calls": raw["calls"]},
    }


BURST_AUTOSCALING = {"min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 1,
                     "upscale_delay": "500ms", "downscale_delay": "60s"}


def burst(client: Any, calls: int = 400) -> dict[str, Any]:
    """``calls`` calls of a 20 ms endpoint (``max_concurrency=1``) sent at once to an
    autoscaled service of one replica (``BURST_AUTOSCALING``): the calls queue on that
    replica, the autoscaler adds replicas, and the queued calls spread over them.

    Returns the time until the last call is answered against the time one replica alone
    would take (``calls`` x 20 ms), the latency quantiles, the replicas at most, and the
    calls given back to be sent to added replicas (``calls-rebalanced`` events)."""
    svc = Step.options(max_concurrency=1, max_queued=calls + 1,
                       autoscaling=BURST_AUTOSCALING).as_service(client=client)

    async def run() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        latencies: list[float] = []
        most = 0

        async def one(i: int) -> None:
            start = loop.time()
            assert await svc.work.route(i) == i
            latencies.append(loop.time() - start)

        start = loop.time()
        sent = asyncio.ensure_future(asyncio.gather(*(one(i) for i in range(calls))))
        while not sent.done():
            table = await client.scheduler.replicated_table(name=svc.name)
            most = max(most, len(table["replicas"]) if table else 0)
            await asyncio.wait([sent], timeout=0.1)
        await sent
        return {"seconds": loop.time() - start, "latencies": latencies, "most": most}

    try:
        raw = client.sync(run)
        moved = sum(e.get("moved", 0) for _, e in client.get_events("dask_services")
                    if e.get("action") == "calls-rebalanced" and e.get("service") == svc.name)
    finally:
        svc.shutdown()
    one_replica = calls * STEP_SERVICE_TIME
    return {"calls": calls, "seconds": raw["seconds"], "one_replica_s": one_replica,
            "ratio_to_one_replica": raw["seconds"] / one_replica,
            **_quantiles(raw["latencies"]), "replicas_max": raw["most"], "moved": moved}


def recovered_after(calls: list[tuple[float, float]], during: float, window: float,
                    limit: float) -> float | None:
    """Seconds from the step (t=0) after which every ``window`` up to ``during`` has its
    p99 latency under ``limit``; None if the last window is still over it."""
    last_bad = None
    t = 0.0
    while t + window <= during:
        lat = sorted(x for f, x in calls if t <= f < t + window)
        if lat and lat[min(len(lat) - 1, int(0.99 * len(lat)))] >= limit:
            last_bad = t + window
        t += window / 4
    if last_bad is not None and last_bad >= during:
        return None
    return 0.0 if last_bad is None else last_bad


def run(client: Any, calls: int = 1000, show_progress: bool = True) -> dict[str, Any]:
    """The gang round trips, the autoscaling load step, then a burst."""
    import os

    return {"gang": gang(client, calls, show_progress), "autoscaling": autoscaling(client),
            "burst": burst(client), "load_average": os.getloadavg()}


def report(result: dict[str, Any]) -> str:
    """The result as markdown tables."""
    g = result["gang"]
    one = g["1 rank"]["p50_ms"]
    lines = ["route on a replica of | p50 ms | p99 ms | p50 / 1-rank p50",
             "--- | --- | --- | ---"]
    for name, q in g.items():
        lines.append(f"{name} | {q['p50_ms']:.3f} | {q['p99_ms']:.3f} | "
                     f"{q['p50_ms'] / one:.2f}")
    a = result["autoscaling"]
    back = a["p99_back_under_3x_after_s"]
    lines += ["", f"autoscaling, 1 -> {a['callers']} callers of a {a['service_ms']:.0f} ms "
                  "endpoint | value", "--- | ---",
              "p99 back under 3x the endpoint's time after | "
              + ("never" if back is None else f"{back:.2f} s"),
              f"replicas added / removed | {a['added']} / {a['removed']}",
              f"replicas at most / at the end | {a['replicas_max']} / {a['replicas_end']}",
              f"calls / failed | {a['calls']} / {a['failed']}"]
    lines += [f"decision | {d}" for d in a["decisions"]]
    b = result.get("burst")
    if b is not None:
        lines += ["", f"burst of {b['calls']} calls of a {STEP_SERVICE_TIME * 1e3:.0f} ms "
                      "endpoint sent at once, autoscaled from 1 replica | value",
                  "--- | ---",
                  f"last call answered after | {b['seconds']:.2f} s "
                  f"({b['ratio_to_one_replica']:.2f}x one replica's "
                  f"{b['one_replica_s']:.0f} s)",
                  f"latency p50 / p99 | {b['p50_ms']:.0f} / {b['p99_ms']:.0f} ms",
                  f"replicas at most | {b['replicas_max']}",
                  f"queued calls moved to added replicas | {b['moved']}"]
    if "load_average" in result:
        lines += ["", "load average (1, 5, 15 min): "
                  + ", ".join(f"{x:.1f}" for x in result["load_average"])]
    return "\n".join(lines)
