"""Fails loudly when a dask/distributed upgrade moves something dask-services relies on.

The scheduler plugin edits scheduler task state directly (see dask_services/scheduler.py);
these are the versions it was written and tested against.
"""

from __future__ import annotations

import inspect
from importlib.metadata import version

import pytest

pytestmark = pytest.mark.timeout(30)

TESTED = {"dask": "2026.8.0", "distributed": "2026.8.0"}


@pytest.mark.parametrize("package", sorted(TESTED))
def test_pinned_versions(package):
    assert version(package) == TESTED[package], (
        f"dask-services was tested with {package}=={TESTED[package]}, found "
        f"{version(package)}; run the whole suite, fix what breaks, then update the pins in "
        "pyproject.toml and here"
    )


def test_scheduler_internals_we_use():
    from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin
    from distributed.scheduler import Scheduler, TaskState

    for attr in ("dependencies", "dependents", "waiting_on", "waiters", "worker_restrictions",
                 "loose_restrictions", "processing_on", "who_has", "run_spec", "priority",
                 "state", "who_wants"):
        assert attr in TaskState.__slots__ or hasattr(TaskState, attr), attr
    for method in ("transitions", "stimulus_queue_slots_maybe_opened", "log_event",
                   "register_worker_plugin", "validate_state", "add_plugin"):
        assert callable(getattr(Scheduler, method, None)), method
    params = inspect.signature(SchedulerPlugin.update_graph).parameters
    assert {"scheduler", "keys", "tasks"} <= set(params)
    assert "stimulus_id" in inspect.signature(SchedulerPlugin.transition).parameters
    assert {"key", "start", "finish"} <= set(inspect.signature(WorkerPlugin.transition).parameters)
    # the transition table entries our restarts go through
    table = Scheduler._TRANSITIONS_TABLE
    for edge in [("processing", "released"), ("memory", "released"), ("released", "waiting"),
                 ("no-worker", "released"), ("waiting", "processing")]:
        assert edge in table, edge


def test_worker_internals_we_use():
    from distributed.worker import Worker, get_worker, secede, thread_state

    assert callable(secede) and callable(get_worker)
    assert hasattr(thread_state, "__dict__")
    src = inspect.getsource(Worker.execute)
    assert "ts.dependencies" in src  # claims run with the scheduler's (cut) dependencies
    from distributed.worker import _run_task

    assert "set_thread_state" in inspect.getsource(_run_task)  # thread_state.key is set


def test_task_spec_fusion_hook():
    from dask._task_spec import GraphNode, Task

    assert isinstance(GraphNode.block_fusion, property)
    assert "block_fusion" in inspect.getsource(
        __import__("dask._task_spec", fromlist=["fuse_linear_task_spec"]).fuse_linear_task_spec
    )
    assert Task.__call__ is not GraphNode.__call__
