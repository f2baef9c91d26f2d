from __future__ import annotations

import os
import sys

import dask
import pytest
from distributed import Client, LocalCluster

sys.path.insert(0, os.path.dirname(__file__))

from services import Recorder  # noqa: E402


@pytest.fixture(autouse=True)
def _reset_recorder():
    Recorder.reset()
    yield
    Recorder.reset()


@pytest.fixture
def small_cluster(tmp_path):
    """Two one-thread worker processes of 600 MB, validation on, spilling under tmp_path."""
    config = {
        "distributed.scheduler.validate": True,
        "distributed.worker.validate": True,
        "temporary-directory": str(tmp_path),
    }
    with dask.config.set(config), LocalCluster(
        n_workers=2, threads_per_worker=1, memory_limit="600MB", dashboard_address=":0",
    ) as cluster, Client(cluster) as client:
        yield cluster, client, tmp_path


@pytest.fixture(autouse=True)
def _fresh_replica_gates():
    """Gates of the replicated-service test classes hold asyncio events bound to one
    test's loop: every test starts and ends without any, even after a failure."""
    from replicated_services import GATES

    GATES.clear()
    yield
    GATES.clear()
