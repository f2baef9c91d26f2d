"""Exceptions keep their type between workers and to the client, whatever their
``__init__`` takes."""

from __future__ import annotations

import threading

import dask
import pytest
from utils import assert_errs, assert_nothing_left, service_cluster

import dask_services
from dask_services._messages import dumps_exception, loads_exception

pytestmark = pytest.mark.timeout(90)


class Coded(Exception):
    """Its ``__init__`` takes a keyword-only argument it does not give ``Exception``."""

    def __init__(self, code, *, reason):
        super().__init__(f"{code}: {reason}")
        self.code = code


class Joined(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")


class Missing(FileNotFoundError):
    def __init__(self, path):
        super().__init__(2, "no such thing", path)
        self.path = path


class Locked(Exception):
    def __init__(self, name):
        super().__init__(name, 1)
        self.name = name
        self.lock = threading.Lock()  # does not pickle


@pytest.mark.parametrize("exc", [
    Coded(3, reason="bad"), Joined(1, 2), Missing("/data/x"), Locked("held"),
    ValueError("plain")], ids=type)
def test_an_exception_keeps_its_type_message_and_attributes(exc):
    """pickle remakes an exception as ``cls(*args)``, which fails where ``__init__`` takes
    other arguments: such exceptions arrived as a ``RuntimeError``."""
    back = loads_exception(dumps_exception(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert back.args == exc.args
    kept = {k: v for k, v in vars(exc).items() if k != "lock"}
    assert {k: v for k, v in vars(back).items() if k != "__notes__"} == kept
    assert "Raised by a service instance" in back.__notes__[-1]


class RaisesCoded(dask_services.Service):
    async def add_key(self, key, data):
        pass

    @dask_services.rpc
    async def fail(self):
        raise Coded(7, reason="from a peer")

    async def all_inputs_done(self):
        others = [sid for sid in self.peers if sid != self.id] or [self.id]
        try:
            await self.peers[others[0]].fail()
        except Coded as e:
            raise Coded(e.code + 1, reason=f"caught {e.code}") from None


@service_cluster()
async def test_a_peer_call_and_the_client_get_the_exception_itself(c, s, a, b):
    xs = [dask.delayed(abs)(i) for i in range(4)]
    outs = c.compute(dask_services.service_task(RaisesCoded, xs, outputs=2))
    for fut in outs:
        exc = await assert_errs(fut, Coded, "8: caught 7")
        assert exc.code == 8
    del outs, fut, exc
    await assert_nothing_left(s, [a, b])
