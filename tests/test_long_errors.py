"""Errors that are long, or that travel over many hops, stay bounded."""

from __future__ import annotations

import asyncio

import dask
import pytest
from utils import assert_errs, assert_nothing_left, service_cluster

import dask_services
from dask_services._messages import dumps_exception, loads_exception

pytestmark = pytest.mark.timeout(120)


def test_an_exception_passed_on_over_many_hops_carries_one_note_per_hop():
    """Each hop (a peer call's answer, the service task's error) notes the traceback it
    came with; the note's text carried every earlier note, so a chain of peer calls
    doubled them at each hop (270 MB at depth 16)."""
    exc: BaseException = ValueError("at the end of the chain")
    for _ in range(16):
        try:
            raise exc
        except ValueError as e:
            exc = loads_exception(dumps_exception(e))
    notes = exc.__notes__
    assert len(notes) == 16
    assert sum(len(n) for n in notes) < 16 * 5_000  # one traceback each
    assert all(n.count("ValueError: at the end of the chain") == 1 for n in notes)


class FailsAtLength(dask_services.Service):
    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        raise ValueError("x" * 200_000)


@service_cluster()
async def test_a_long_error_is_kept_cut_in_the_event_log(
        c, s, a, b):
    """The scheduler kept a failure's message in full in its event log, its logger's
    line, the status table and the run history (a 50 MB message: 64 MB -> 1.4 GB after
    two failures): cut there to ``distributed.admin.max-error-length``."""
    limit = dask.config.get("distributed.admin.max-error-length")
    outs = c.compute(dask_services.service_task(
        FailsAtLength, [dask.delayed(abs)(i) for i in range(2)], outputs=1))
    # (the client's copy distributed cuts, as for any task's error)
    exc = await asyncio.wait_for(assert_errs(outs[0], ValueError, "xxx"), 30)
    (failed,) = [e for _, e in s.get_events("dask_services") if e["action"] == "failed"]
    assert limit < len(failed["detail"]) < limit + 100
    assert failed["detail"].endswith("characters cut)")
    del outs, exc
    await assert_nothing_left(s, [a, b])
