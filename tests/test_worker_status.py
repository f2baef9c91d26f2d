"""Worker status changes read from the scheduler's event log (``_worker_status.py``)."""

from __future__ import annotations

import pytest

from dask_services._worker_status import status_change

pytestmark = pytest.mark.timeout(30)


def test_a_logged_status_change_is_read_with_its_worker_and_stimulus():
    msg = {"action": "worker-status-change", "prev-status": "running",
           "status": "closing_gracefully", "stimulus_id": "retire-workers-1"}
    assert status_change("tcp://w:1", msg) == ("tcp://w:1", "closing_gracefully",
                                               "retire-workers-1")
    assert status_change("tcp://w:1", {"action": "worker-status-change",
                                       "status": "paused"}) == ("tcp://w:1", "paused", "")


@pytest.mark.parametrize("topic, msg", [
    ("tcp://w:1", {"action": "remove-worker"}),  # another event of the worker
    (["tcp://w:1", "all"], {"action": "worker-status-change", "status": "paused"}),
    ("dask_services", "a text event"),
])
def test_other_events_are_not_status_changes(topic, msg):
    assert status_change(topic, msg) is None
