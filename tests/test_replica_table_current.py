"""status(client, table="replicas") is current when asked, like svc.metrics(): it does not
wait for the workers' next heartbeat."""

from __future__ import annotations

import pytest
from replicated_services import Adder
from utils import service_cluster

pytestmark = pytest.mark.timeout(60)


@service_cluster()
async def test_the_replica_table_shows_calls_made_just_before_it_is_asked(c, s, a, b):
    for w in (a, b):  # no heartbeat will bring the figures
        w.periodic_callbacks["heartbeat"].stop()
    svc = await Adder.options(replicas=2, name="fresh").as_service(1, client=c)
    assert [await svc.add.route(i) for i in range(5)] == [1, 2, 3, 4, 5]
    metrics = await svc.metrics()
    assert sum(m["calls"] for m in metrics) == 5

    rows = [dict(r) for r in
            (await c.scheduler.service_status(tables=["replicas"]))["replicas"]]
    assert sum(r["calls"] for r in rows) == 5, rows
    assert all(r["p99_ms"] > 0 for r in rows if r["calls"])
    by_id = {m["id"]: m["calls"] for m in metrics}
    assert {r["replica"]: r["calls"] for r in rows} == by_id
    await svc.shutdown()
