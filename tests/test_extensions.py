"""Extensions are plugins of their own: each works without the others."""

from __future__ import annotations

import pytest
from distributed.utils_test import gen_cluster
from replicated_services import Adder

from dask_services._plugins import scheduler_plugins
from dask_services.client import _installed
from dask_services.replicated._scheduler import Deployments

pytestmark = pytest.mark.timeout(60)


@gen_cluster(client=True)
async def test_replicated_services_work_without_the_service_task_core(c, s, a, b):
    await c.register_plugin(Deployments())
    _installed.add(c)  # as_service() would install every plugin
    try:
        svc = await Adder.options(replicas=2).as_service(1, client=c)
        assert await svc.add.route(1) == 2
        assert "dask_services" not in s.extensions
        assert all("dask_services" not in w.extensions for w in (a, b))
        assert all("dask_services_replicated" in w.extensions for w in (a, b))
        await svc.shutdown()
    finally:
        _installed.discard(c)


def test_the_core_comes_first_and_the_extensions_after_it():
    names = [p.name for p in scheduler_plugins()]
    assert names == ["dask_services", "dask_services_replicated",
                     "dask_services_diagnostics"]
