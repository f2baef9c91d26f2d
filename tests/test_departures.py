"""Waiting for a worker whose connection broke to leave (``_departures.py``)."""

from __future__ import annotations

import asyncio

import pytest

from dask_services.replicated._departures import Departures

pytestmark = pytest.mark.timeout(30)


def test_a_worker_already_gone_answers_at_once():
    departures = Departures()
    assert asyncio.run(departures.any_gone_within(["a", "b"], lambda w: w != "b", 60))


def test_a_waiter_wakes_when_one_of_its_workers_leaves_and_leaves_nothing_behind():
    async def main():
        departures = Departures()
        present = {"a", "b"}
        waiting = asyncio.ensure_future(departures.any_gone_within(
            ["a", "b"], present.__contains__, 60))
        while not departures._waiting:
            await asyncio.sleep(0)
        present.discard("b")
        departures.left("b")
        assert await asyncio.wait_for(waiting, 5)
        assert departures._waiting == {}

    asyncio.run(main())


def test_a_worker_that_stays_answers_false_after_the_timeout():
    async def main():
        departures = Departures()
        departures.left("other")  # nobody waits for it: nothing happens
        assert not await departures.any_gone_within(["a"], lambda w: True, 0.05)
        assert departures._waiting == {}

    asyncio.run(main())
