"""The instance host on its own: calls that arrive early, inputs handed off twice."""

from __future__ import annotations

import asyncio
import inspect
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
        await until(lambda: suspended_in(call, "ServiceHost.created", host))
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


class WireEnvironment(LocalEnvironment):
    """Peer calls to other addresses wait for the test to answer them."""

    def __init__(self, directory: str) -> None:
        super().__init__(directory)
        self.answer: asyncio.Future = asyncio.get_running_loop().create_future()
        self.answered = False

    async def send_rpc(self, *args: Any, **kwargs: Any) -> Any:
        result = await self.answer
        self.answered = True  # where the real one counts the call's bytes
        return result


def waiting_for_calls(task: asyncio.Task) -> bool:
    """Whether ``task`` is parked in ``asyncio.wait`` (the stop's wait for its calls)."""
    coro = task.get_coro()
    while inspect.iscoroutine(coro):
        if coro.cr_code.co_qualname == "wait" and coro.cr_frame.f_globals is vars(asyncio.tasks):
            return coro.cr_suspended
        coro = coro.cr_await
    return False


def test_stopping_waits_for_the_answer_to_a_peer_call_on_the_wire(tmp_path):
    """The caller's hook is cancelled at once; the call itself runs to its answer, so that
    both sides count it or neither does (_counters.py)."""
    async def main():
        env = WireEnvironment(str(tmp_path))
        host = ServiceHost(env)
        s = spec(1)
        remote = ServiceId("t-1.1")
        s = InstanceSpec(**{**vars(s), "peers": {s.id: env.address, remote: "tcp://peer"}})
        inst = host.create(s)
        await host.start(inst)
        call = asyncio.create_task(inst.service.peers[remote].ping(1))
        await until(lambda: inst.outgoing)
        call.cancel()  # as the stop cancels the hook making it
        with pytest.raises(asyncio.CancelledError):
            await call  # the caller no longer waits ...
        assert inst.outgoing
        stopping = asyncio.create_task(host.stop(s.id))
        await until(lambda: waiting_for_calls(stopping))
        assert not stopping.done() and not env.answered  # ... but the stop does
        env.answer.set_result(None)
        await stopping
        assert env.answered and not inst.outgoing and s.id not in host.instances

    asyncio.run(main())
