"""The services' threads on a worker: a stopped instance's jobs do not take them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest
from distributed.utils_test import poll_for

from dask_services._threads import LateJobWatch, ServiceThreads

pytestmark = pytest.mark.timeout(30)


def test_a_job_still_running_after_its_instance_stopped_gets_a_thread_of_its_own():
    threads = ServiceThreads(1, thread_name_prefix="test")
    gate, entered = threading.Event(), threading.Event()

    def blocked() -> str:
        entered.set()
        gate.wait(20)
        return "blocked"

    try:
        stuck = threads.submit(blocked)
        assert entered.wait(10)
        queued_of_the_stopped = threads.submit(lambda: "never")
        later = threads.submit(lambda: "later")  # another instance's, queued behind it
        assert threads.let_go({stuck, queued_of_the_stopped}) == 1
        assert queued_of_the_stopped.cancelled()
        assert later.result(timeout=10) == "later"  # waited for the gate before
        assert threads.held == 1 and not stuck.done()
        gate.set()
        assert stuck.result(timeout=10) == "blocked"
        # the job's done callbacks run just after its result is set
        poll_for(lambda: threads.held == 0, timeout=5)
        assert threads.executor._max_workers == 1
        assert threads.let_go({stuck}) == 0  # done already: nothing held
        assert threads.submit(lambda: 3).result(timeout=10) == 3
    finally:
        gate.set()
        threads.shutdown()


def test_a_late_job_is_warned_about_once_its_grace_ends_and_a_returned_one_never():
    async def main() -> tuple[list[int], dict]:
        watch = LateJobWatch()
        warned: list[int] = []
        returned, late = concurrent.futures.Future(), concurrent.futures.Future()
        done_already = concurrent.futures.Future()
        done_already.set_result(None)
        watch.watch([done_already], 0.05, warned.append)  # nothing running: no watch
        assert not watch.watches
        watch.watch([returned], 0.2, warned.append)
        watch.watch([late, done_already], 0.2, warned.append)
        assert len(watch.watches) == 2
        threading.Thread(target=returned.set_result, args=(1,)).start()  # a job's thread
        while len(watch.watches) == 2:  # the returned job's watch is dropped on the loop
            await asyncio.sleep(0.005)
        while watch.watches:  # the late job's grace ends
            await asyncio.sleep(0.01)
        late.set_result(None)
        return warned, watch.watches

    warned, left = asyncio.run(main())
    assert warned == [1] and not left


def test_closing_the_watch_drops_its_warnings():
    async def main() -> None:
        watch = LateJobWatch()
        job = concurrent.futures.Future()
        watch.watch([job], 60, lambda running: None)
        (timer,) = watch.watches
        watch.close()
        assert not watch.watches and timer.cancelled()

    asyncio.run(main())
