"""The passes spreading a deployment's queued calls (``_rebalancer``), without a cluster:
replicas are figures in a dict, shedding moves queued calls to the least loaded replica
when the test says the callers have sent them on."""

from __future__ import annotations

import asyncio
import logging

import pytest

from dask_services.replicated._rebalancer import Rebalancer

pytestmark = pytest.mark.timeout(30)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


class FakeReplicas:
    """Replica id -> [running, queued, moved_in]; calls given back wait in ``in_transit``
    until ``land()`` sends them to the replica with least to do."""

    def __init__(self, **loads: tuple[int, int]) -> None:
        self.figures = {rid: [running, queued, 0] for rid, (running, queued) in loads.items()}
        self.in_transit = 0
        self.stats_calls = 0
        self.sheds: list[tuple[str, int]] = []
        self.events: list[dict] = []
        self.gate: asyncio.Event | None = None  # held: ``stats`` waits for it
        self.stopping = False
        self.tasks: list[asyncio.Task] = []

    def rebalancer(self) -> Rebalancer:
        return Rebalancer(
            "svc", healthy=lambda: {rid: f"worker-{rid}" for rid in self.figures},
            stats=self.stats, shed=self.shed, spawn=self.spawn,
            log_event=self.events.append, stopping=lambda: self.stopping)

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.tasks.append(task)
        return task

    async def stats(self, placed) -> dict[str, dict]:
        self.stats_calls += 1
        if self.gate is not None:
            await self.gate.wait()
        return {rid: {"in_flight": f[0], "queued": f[1], "moved_in": f[2]}
                for rid, f in self.figures.items() if rid in placed}

    async def shed(self, worker: str, rid: str, keep: int, table: list) -> int:
        assert worker == f"worker-{rid}"
        assert sorted(row[0] for row in table) == sorted(self.figures)
        running, queued, _ = self.figures[rid]
        given = min(queued, max(0, running + queued - keep))
        self.figures[rid][1] -= given
        self.in_transit += given
        self.sheds.append((rid, given))
        return given

    def land(self) -> None:
        while self.in_transit:
            rid = min(self.figures, key=lambda r: (sum(self.figures[r][:2]), r))
            self.figures[rid][1] += 1
            self.figures[rid][2] += 1
            self.in_transit -= 1

    def load(self) -> list[int]:
        return sorted(f[0] + f[1] for f in self.figures.values())

    async def settle(self) -> None:
        while not all(t.done() for t in self.tasks):
            await asyncio.gather(*self.tasks, return_exceptions=True)


def test_a_pass_gives_back_the_calls_beyond_the_even_share_and_logs_how_many():
    async def main():
        fake = FakeReplicas(a=(1, 8), b=(0, 0), c=(0, 0))
        fake.rebalancer().soon()
        await fake.settle()
        assert fake.sheds == [("a", 6)]
        assert fake.events == [{"action": "calls-rebalanced", "service": "svc", "moved": 6,
                                "healthy": 3}]
        fake.land()
        assert fake.load() == [3, 3, 3]

    run(main())


def test_one_healthy_replica_or_an_even_load_sheds_nothing():
    async def main():
        for loads in ({"a": (1, 8)}, {"a": (1, 2), "b": (2, 1)}):
            fake = FakeReplicas(**loads)
            fake.rebalancer().soon()
            await fake.settle()
            assert fake.sheds == [] and fake.events == []

    run(main())


def test_a_replica_turning_healthy_during_a_pass_asks_for_one_more_pass_not_two():
    async def main():
        fake = FakeReplicas(a=(1, 0), b=(0, 0))
        fake.gate = asyncio.Event()
        rebalancer = fake.rebalancer()
        rebalancer.soon()
        await asyncio.sleep(0)  # the first pass asks for figures and waits
        assert fake.stats_calls == 1
        rebalancer.soon()
        rebalancer.soon()
        assert len(fake.tasks) == 1 and rebalancer.again
        fake.gate.set()
        await fake.settle()
        assert fake.stats_calls == 2  # the first pass, then one more
        assert not rebalancer.again

    run(main())


def test_the_next_pass_waits_for_the_calls_the_last_one_moved_to_land():
    async def main():
        fake = FakeReplicas(a=(1, 8), b=(0, 0), c=(0, 0))
        rebalancer = fake.rebalancer()
        rebalancer.soon()
        await fake.settle()
        assert rebalancer.moved_landed_by == 6
        rebalancer.soon()  # the calls are still with their callers
        async with asyncio.timeout(5):
            while fake.stats_calls < 4:  # the pass polls: not landed yet
                await asyncio.sleep(0.01)
        assert fake.sheds == [("a", 6)]
        fake.land()
        await fake.settle()
        # had it not waited, ``a`` (1, 2) against empty replicas would have shed again
        assert fake.sheds == [("a", 6)]
        assert fake.load() == [3, 3, 3]

    run(main())


def test_replicas_removed_forget_the_moved_calls_so_no_pass_waits_for_them():
    async def main():
        fake = FakeReplicas(a=(1, 8), b=(0, 0), c=(0, 0))
        rebalancer = fake.rebalancer()
        rebalancer.soon()
        await fake.settle()
        rebalancer.forget_moved()
        fake.in_transit = 0  # their callers left
        start = asyncio.get_running_loop().time()
        rebalancer.soon()
        await fake.settle()
        assert asyncio.get_running_loop().time() - start < 1.0
        assert fake.stats_calls == 2

    run(main())


def test_callers_let_go_are_counted_once_per_handle_and_spread_once_landed():
    async def main():
        fake = FakeReplicas(a=(0, 0), b=(0, 0))
        rebalancer = fake.rebalancer()
        rebalancer.woken("handle-1", 3)
        rebalancer.woken("handle-1", 5)  # the same handle's later ask: 2 more
        rebalancer.woken("handle-1", 4)  # fewer than let go already: nothing
        rebalancer.woken("handle-2", 1)
        assert rebalancer.woken_released == 6
        assert len(fake.tasks) == 1  # one wait for them to land
        # the callers let go send their calls to the first replica healthy
        fake.figures["a"][1] = 6
        await fake.settle()
        assert rebalancer.woken_released == 0 and rebalancer.woken_by == {}
        fake.land()
        assert fake.sheds == [("a", 3)] and fake.load() == [3, 3]

    run(main())


def test_a_stopping_deployment_runs_no_pass():
    async def main():
        fake = FakeReplicas(a=(1, 8), b=(0, 0))
        fake.stopping = True
        rebalancer = fake.rebalancer()
        rebalancer.soon()
        rebalancer.woken("handle", 3)
        await fake.settle()
        assert fake.sheds == [] and fake.stats_calls == 0
        assert len(fake.tasks) == 2  # the pass and the wait, each ended at once

    run(main())


def test_a_failing_pass_is_logged_and_leaves_the_calls_where_they_are(caplog):
    async def main():
        fake = FakeReplicas(a=(1, 8), b=(0, 0))

        async def broken(placed):
            raise RuntimeError("figures unavailable")

        rebalancer = fake.rebalancer()
        rebalancer._stats = broken
        rebalancer.soon()
        await fake.settle()
        assert fake.tasks[0].exception() is None
        assert fake.sheds == []

    with caplog.at_level(logging.ERROR, logger="dask_services"):
        run(main())
    assert "spreading the queued calls of svc over its replicas failed" in caplog.text
