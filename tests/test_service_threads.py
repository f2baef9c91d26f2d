"""The services' threads on a worker: a stopped instance's jobs do not take them."""

from __future__ import annotations

import threading

import pytest
from distributed.utils_test import poll_for

from dask_services._threads import ServiceThreads

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
