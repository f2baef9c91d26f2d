"""The instance host on its own: calls that arrive early, inputs handed off twice."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from utils import suspended_in, until

from dask_services import Service, ServiceId, rpc
from dask_services._host import InstanceSpec, ServiceHost
from dask_services.local import LocalEnvironment

pytestmark = pytest.mark.timeout(30)


class Counter(Service):
    async def start(self, id, key, peers, input_keys, output_keys, concierge, leader,
                    **kwargs: Any) -> None:
        self.added: list[Any] = []

    async def add_key(self, key, data) -> None:
        self.added.append(key)

    @rpc
    async def ping(self, value: int) -> int:
        return value + 1


def spec(run_id: int) -> InstanceSpec:
    sid = ServiceId(f"t-{run_id}.0")
    return InstanceSpec(service_key="svc", run_id=run_id, id=sid, peers={sid: "inproc://x"},
                        input_keys=["a", "b"], output_keys=[], wanted=[], owners={},
                        leader=sid, service_class=Counter, params={})


def arguments(args: tuple, kwargs: dict | None = None):
    """What a call's handler gives ``ServiceHost.deliver``: a coroutine function that
    returns the call's arguments."""

    async def load():
        return args, kwargs or {}

    return load


def test_a_call_for_a_run_not_created_yet_waits_for_it(tmp_path):
    async def main():
        host = ServiceHost(LocalEnvironment(str(tmp_path)))
        s = spec(3)
        call = asyncio.create_task(host.deliver(s.id, s.id, 3, 0, "ping", arguments((1,))))
        # the start message has not arrived yet: the call waits for the instance
        await until(lambda: suspended_in(call, "ServiceHost._created", host))
        assert not call.done()
        await host.start(host.create(s))
        assert await call == 2
        # a call for an older run that never came here is refused at once
        with pytest.raises(Exception, match="no longer current"):
            await host.deliver(ServiceId("t-2.0"), s.id, 2, 0, "ping", arguments((1,)))
        await host.stop_all()

    asyncio.run(main())


def test_an_input_handed_off_twice_is_added_once_and_a_released_one_not_at_all(tmp_path):
    async def main():
        host = ServiceHost(LocalEnvironment(str(tmp_path)))
        s = spec(1)
        inst = host.create(s)
        await host.start(inst)
        assert await host.add_key(s.id, "a", 1)
        assert await host.add_key(s.id, "a", 1)  # again: already there
        assert not await host.add_key(s.id, "b", 2, still_wanted=lambda: False)
        assert inst.service.added == ["a"]
        await host.stop_all()

    asyncio.run(main())
