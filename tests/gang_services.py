"""Services of several ranks and autoscaled services used by the tests (importable by
worker processes)."""

from __future__ import annotations

import asyncio

from unruly_services import let_out

import dask_services


class Sharded(dask_services.Service):
    """Each rank holds a shard (its rank + 1); ranks all-gather through ``@rpc`` calls."""

    async def setup(self, fail_rank: int | None = None, barrier: bool = False) -> None:
        if fail_rank == self.rank:
            raise ValueError(f"setup refused on rank {self.rank}")
        self.shard = self.rank + 1
        self.calls = 0
        self.log: list[int] = []
        if barrier:  # setup talks to the other ranks: they all set up at once
            await asyncio.gather(*(self.ranks[r].shard_of() for r in self.ranks))

    @dask_services.rpc
    async def shard_of(self) -> int:
        return self.shard

    @dask_services.rpc
    async def part(self, x: int) -> int:
        return x * self.shard

    @dask_services.rpc
    async def append(self, i: int) -> None:
        self.log.append(i)

    @dask_services.rpc
    async def get_log(self) -> list[int]:
        return list(self.log)

    @dask_services.rpc
    async def get_calls(self) -> int:
        return self.calls

    @dask_services.endpoint
    async def total(self, x: int, delay: float = 0.0) -> int:
        """Every rank counts the call and all-gathers x * shard: x * (1 + ... + n)."""
        self.calls += 1
        if delay:
            await asyncio.sleep(delay)
        parts = await asyncio.gather(*(self.ranks[r].part(x) for r in self.ranks))
        return sum(parts)

    @dask_services.endpoint(ranks="first")
    async def info(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "id": str(self.id),
                "ranks": list(self.ranks)}

    @dask_services.endpoint(ranks="first")
    async def calls_per_rank(self) -> list[int]:
        return list(await asyncio.gather(*(self.ranks[r].get_calls() for r in self.ranks)))

    @dask_services.endpoint(ranks="first")
    async def ordered(self, n: int) -> list[int]:
        """n calls to rank 1 made without waiting for each other start in order."""
        sends = [asyncio.ensure_future(self.ranks[1].append(i)) for i in range(n)]
        await asyncio.gather(*sends)
        return await self.ranks[1].get_log()

    @dask_services.endpoint(ranks="first")
    async def out_of_order(self) -> list[int]:
        """A call to rank 1 made and never awaited, then two awaited in the reverse of the
        order they were made in, then one more: rank 1's log of these calls."""
        before = len(await self.ranks[1].get_log())
        forgotten = self.ranks[1].append(-1)
        first, second = self.ranks[1].append(1), self.ranks[1].append(2)
        forgotten.close()
        await second
        await first
        await self.ranks[1].append(3)
        return (await self.ranks[1].get_log())[before:]

    @dask_services.endpoint
    def sync_total(self, x: int) -> int:
        self.calls += 1
        return x * self.shard


class Sleeper(dask_services.Service):
    """An endpoint that takes a fixed time: the load of the autoscaling tests."""

    async def setup(self, seconds: float = 0.02) -> None:
        self.seconds = seconds

    @dask_services.endpoint
    async def work(self, x: int) -> int:
        await asyncio.sleep(self.seconds)
        return x + 1


class UnrulyGang(dask_services.Service):
    """Rank 1 lets out what an ``Exception`` handler does not catch, from an endpoint or
    from an ``@rpc`` method rank 0 calls (``what``: "kb", "exit", "genexit", "stop")."""

    @dask_services.endpoint
    async def on_every_rank(self, what: str) -> int:
        if self.rank == 1:
            let_out(what, "on rank 1")
        return self.rank

    @dask_services.endpoint
    def on_every_rank_sync(self, what: str) -> int:
        if self.rank == 1:
            let_out(what, "on rank 1")
        return self.rank

    @dask_services.rpc
    async def part(self, what: str) -> int:
        if self.rank == 1:
            let_out(what, "on rank 1")
        return self.rank

    @dask_services.endpoint(ranks="first")
    async def through_rank_calls(self, what: str) -> list[int]:
        return list(await asyncio.gather(*(self.ranks[r].part(what) for r in self.ranks)))
