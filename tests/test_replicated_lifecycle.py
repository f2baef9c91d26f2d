"""The replica lifecycle state machine on its own (no cluster, no I/O)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_services.replicated import _lifecycle as lc
from dask_services.replicated._lifecycle import ReplicaMachine, ReplicaState
from dask_services.service import ServiceId

pytestmark = pytest.mark.timeout(60)


def placed(m: ReplicaMachine, worker: str) -> list[lc.Action]:
    """Answer the pending Launch by placing the replica on ``worker``."""
    return m.handle(lc.Placed(m.id, worker))


def healthy_on(worker: str = "a", attempts: int = 3) -> ReplicaMachine:
    m = ReplicaMachine("svc.0", attempts)
    assert m.start() == [lc.Launch(m.id, frozenset())]
    assert placed(m, worker) == [lc.StartOn(m.id, worker)]
    assert m.handle(lc.SetupSucceeded(m.id)) == [lc.StateChanged(ReplicaState.HEALTHY)]
    return m


def test_first_setup_makes_it_healthy():
    m = healthy_on("a")
    assert m.state is ReplicaState.HEALTHY
    assert m.worker == "a" and m.id == "svc.0.1" and m.last_error is None


def test_worker_lost_relaunches_elsewhere_with_a_new_id():
    m = healthy_on("a")
    old = m.id
    actions = m.handle(lc.WorkerLost("a"))
    assert actions == [lc.StateChanged(ReplicaState.RECOVERING),
                       lc.Launch(m.id, frozenset({"a"}))]
    assert m.id != old and m.worker is None
    assert "left the cluster" in m.last_error
    assert placed(m, "b") == [lc.StartOn(m.id, "b")]
    assert m.handle(lc.SetupSucceeded(m.id)) == [lc.StateChanged(ReplicaState.HEALTHY)]
    assert m.worker == "b"


def test_events_about_other_workers_or_old_incarnations_are_ignored():
    m = healthy_on("a")
    old = m.id
    assert m.handle(lc.WorkerLost("b")) == []
    assert m.handle(lc.WorkerRetiring("b")) == []
    m.handle(lc.WorkerLost("a"))
    assert m.handle(lc.SetupSucceeded(old)) == []  # a late answer of the lost incarnation
    assert m.handle(lc.ProbeFailed(old, "late")) == []
    assert m.state is ReplicaState.RECOVERING


def test_probe_failure_stops_the_old_instance_and_relaunches():
    m = healthy_on("a")
    old = m.id
    actions = m.handle(lc.ProbeFailed(old, "timeout"))
    assert actions == [lc.Stop(old, "a", drain=False),
                       lc.StateChanged(ReplicaState.RECOVERING),
                       lc.Launch(m.id, frozenset({"a"}))]
    assert "timeout" in m.last_error


def test_retiring_worker_drains_and_moves():
    m = healthy_on("a")
    old = m.id
    actions = m.handle(lc.WorkerRetiring("a"))
    assert actions[0] == lc.Stop(old, "a", drain=True)
    assert actions[-1] == lc.Launch(m.id, frozenset({"a"}))
    assert m.state is ReplicaState.RECOVERING


def test_setup_failing_repeatedly_ends_unhealthy_with_the_error():
    m = ReplicaMachine("svc.0", max_setup_attempts=2)
    m.start()
    placed(m, "a")
    actions = m.handle(lc.SetupFailed(m.id, "ValueError: bad path"))
    assert actions == [lc.Launch(m.id, frozenset({"a"}))]  # retried, elsewhere if possible
    assert m.state is ReplicaState.UNINITIALIZED
    placed(m, "b")
    assert m.handle(lc.SetupFailed(m.id, "ValueError: bad path")) == [
        lc.StateChanged(ReplicaState.UNHEALTHY)]
    assert m.last_error == "ValueError: bad path"
    assert m.handle(lc.WorkerAdded()) == []  # unhealthy is final until stopped
    assert m.handle(lc.StopRequested()) == [lc.StateChanged(ReplicaState.STOPPED)]


def test_a_success_resets_the_failure_count():
    m = ReplicaMachine("svc.0", max_setup_attempts=2)
    m.start()
    placed(m, "a")
    m.handle(lc.SetupFailed(m.id, "flaky"))
    placed(m, "a")
    m.handle(lc.SetupSucceeded(m.id))
    m.handle(lc.WorkerLost("a"))
    placed(m, "b")
    assert m.handle(lc.SetupFailed(m.id, "flaky")) == [lc.Launch(m.id, frozenset({"b"}))]
    assert m.state is ReplicaState.RECOVERING


def test_launch_failures_that_are_not_setup_do_not_count():
    m = ReplicaMachine("svc.0", max_setup_attempts=1)
    m.start()
    placed(m, "a")
    assert m.handle(lc.LaunchLost(m.id, "CommClosedError")) == [
        lc.Launch(m.id, frozenset({"a"}))]
    assert m.state is ReplicaState.UNINITIALIZED


def test_workers_dying_while_they_start_it_end_unhealthy_past_the_allowance():
    """A worker lost while it starts the replica (the start's connection broke once sent,
    or the worker left while its setup ran) counts: more than ``max_lost_in_setup`` in a
    row and the replica is unhealthy, saying ``setup()`` may be what kills them; a setup
    that succeeds resets the count, and workers lost otherwise never count."""
    m = ReplicaMachine("svc.0", max_lost_in_setup=2)
    m.start()
    placed(m, "a")
    assert m.handle(lc.LaunchLost(m.id, "a lost", in_flight=True)) == [
        lc.Launch(m.id, frozenset({"a"}))]
    placed(m, "b")
    actions = m.handle(lc.WorkerLost("b"))  # before the start's answer
    assert actions == [lc.Launch(m.id, frozenset({"b"}))]
    placed(m, "c")
    assert m.handle(lc.LaunchLost(m.id, "c lost", in_flight=True)) == [
        lc.StateChanged(ReplicaState.UNHEALTHY)]
    assert m.worker is None and m.lost_in_setup == 3
    assert "3 times in a row" in m.last_error and "allowed-failures=2" in m.last_error
    assert "last: c lost" in m.last_error
    m.validate()
    # reset by a setup that succeeds; a healthy replica's lost worker does not count
    m = ReplicaMachine("svc.0", max_lost_in_setup=1)
    m.start()
    placed(m, "a")
    m.handle(lc.WorkerLost("a"))
    placed(m, "b")
    m.handle(lc.SetupSucceeded(m.id))
    assert m.lost_in_setup == 0
    m.handle(lc.WorkerLost("b"))
    placed(m, "c")
    assert m.lost_in_setup == 0 and m.state is ReplicaState.RECOVERING
    # a gang: the other ranks are stopped, and no relaunch
    m = ReplicaMachine("svc.0", size=2, max_lost_in_setup=0)
    (launch,) = m.start()
    m.handle(lc.Placed(launch.id, "a", ("b",)))
    assert m.handle(lc.WorkerLost("b")) == [
        lc.Stop(launch.id, "a", drain=False, others=()),
        lc.StateChanged(ReplicaState.UNHEALTHY)]
    assert m.workers == ()
    m.validate()
    with pytest.raises(ValueError, match="max_lost_in_setup"):
        ReplicaMachine("x", max_lost_in_setup=-1)


def test_workers_dying_while_it_is_probed_end_unhealthy_past_the_allowance():
    """A worker lost while the replica's health probe ran (its connection broke once the
    probe was sent, or the worker left while the probe was under way) counts: more than
    ``max_lost_in_probe`` in a row and the replica is unhealthy, saying
    ``check_health()`` may be what kills them; a probe that passes resets the count, and
    workers lost while no probe ran never count."""
    m = ReplicaMachine("svc.0", max_lost_in_probe=1)
    m.start()
    placed(m, "a")
    m.handle(lc.SetupSucceeded(m.id))
    sid = m.id
    assert m.handle(lc.WorkerLost("a", probing=frozenset({sid}))) == [
        lc.StateChanged(ReplicaState.RECOVERING), lc.Launch(m.id, frozenset({"a"}))]
    assert m.lost_in_probe == 1
    placed(m, "b")
    m.handle(lc.SetupSucceeded(m.id))  # a setup that succeeds does not reset it
    assert m.lost_in_probe == 1
    assert m.handle(lc.ProbeFailed(m.id, "b lost", in_flight=True)) == [
        lc.Stop(m.id, "b", drain=False), lc.StateChanged(ReplicaState.UNHEALTHY)]
    assert m.worker is None and m.lost_in_probe == 2
    assert "health probe of the replica ran 2 times in a row" in m.last_error
    assert "allowed-failures=1" in m.last_error and "check_health() itself" in m.last_error
    assert "last: health probe failed: b lost" in m.last_error
    m.validate()
    # reset by a probe that passes; lost otherwise, or probing another replica: not counted
    m = ReplicaMachine("svc.0", max_lost_in_probe=1)
    m.start()
    placed(m, "a")
    m.handle(lc.SetupSucceeded(m.id))
    m.handle(lc.WorkerLost("a", probing=frozenset({m.id})))
    placed(m, "b")
    m.handle(lc.SetupSucceeded(m.id))
    m.handle(lc.ProbePassed(m.id))
    assert m.lost_in_probe == 0
    m.handle(lc.WorkerLost("b", probing=frozenset({ServiceId("other.0.1")})))
    placed(m, "c")
    m.handle(lc.SetupSucceeded(m.id))
    m.handle(lc.ProbeFailed(m.id, "probe timed out"))
    assert m.lost_in_probe == 0 and m.state is ReplicaState.RECOVERING
    # a gang: the other ranks are stopped
    m = ReplicaMachine("svc.0", size=2, max_lost_in_probe=0)
    (launch,) = m.start()
    m.handle(lc.Placed(launch.id, "a", ("b",)))
    m.handle(lc.SetupSucceeded(launch.id))
    assert m.handle(lc.WorkerLost("b", probing=frozenset({launch.id}))) == [
        lc.Stop(launch.id, "a", drain=False, others=()),
        lc.StateChanged(ReplicaState.UNHEALTHY)]
    m.validate()
    with pytest.raises(ValueError, match="max_lost_in_probe"):
        ReplicaMachine("x", max_lost_in_probe=-1)


def test_no_worker_waits_for_one():
    m = ReplicaMachine("svc.0")
    m.start()
    assert m.handle(lc.NoWorker(m.id)) == []
    assert m.waiting_for_worker
    waiting = m.id
    actions = m.handle(lc.WorkerAdded())
    # launched again under the id it waited with (never placed, so nobody knows it): a
    # cluster whose workers join one by one does not burn an id for each
    assert actions == [lc.Launch(waiting, frozenset())] and m.id == waiting
    assert healthy_on().handle(lc.WorkerAdded()) == []


def test_stop_from_any_state_and_stopped_is_final():
    m = healthy_on("a")
    old = m.id
    assert m.handle(lc.StopRequested()) == [lc.Stop(old, "a", drain=True),
                                            lc.StateChanged(ReplicaState.STOPPED)]
    for event in (lc.WorkerLost("a"), lc.SetupSucceeded(m.id), lc.WorkerAdded(),
                  lc.StopRequested()):
        assert m.handle(event) == []
    pending = ReplicaMachine("svc.1")
    pending.start()  # not placed yet: nothing to stop on a worker
    assert pending.handle(lc.StopRequested()) == [lc.StateChanged(ReplicaState.STOPPED)]


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_setup_attempts"):
        ReplicaMachine("x", 0)
    m = healthy_on()
    with pytest.raises(RuntimeError, match="once"):
        m.start()


WORKERS = ["a", "b", "c"]


def events_for(m: ReplicaMachine):
    """A strategy of plausible events given the machine's current incarnation."""
    return st.one_of(
        st.sampled_from(WORKERS).map(lambda w: lc.Placed(m.id, w)),
        st.just(lc.NoWorker(m.id)),
        st.just(lc.WorkerAdded()),
        st.just(lc.SetupSucceeded(m.id)),
        st.just(lc.SetupFailed(m.id, "boom")),
        st.just(lc.LaunchLost(m.id, "lost")),
        st.just(lc.LaunchLost(m.id, "lost while starting", in_flight=True)),
        st.sampled_from(WORKERS).map(lc.WorkerLost),
        st.sampled_from(WORKERS).map(lambda w: lc.WorkerLost(w, probing=frozenset({m.id}))),
        st.sampled_from(WORKERS).map(lc.WorkerRetiring),
        st.just(lc.ProbeFailed(m.id, "slow")),
        st.just(lc.ProbeFailed(m.id, "lost while probed", in_flight=True)),
        st.just(lc.ProbePassed(m.id)),
        st.just(lc.StopRequested()),
        st.just(lc.SetupSucceeded("svc.0.0")),  # a stale id
    )


@settings(max_examples=150, deadline=None)
@given(st.data(), st.integers(1, 4), st.integers(0, 3))
def test_invariants_hold_for_any_sequence_of_events(data, attempts, lost_allowed):
    m = ReplicaMachine("svc.0", attempts, max_lost_in_setup=lost_allowed,
                       max_lost_in_probe=lost_allowed)
    seen_ids: set = set()
    unplaced: set = set()  # launched ids answered with NoWorker: nobody else knows them
    actions = m.start()
    was_healthy = False
    for _ in range(30):
        for a in actions:
            if isinstance(a, lc.Launch):
                # never reused, but for an id never placed, launched again as it is
                assert a.id == m.id and (a.id not in seen_ids or a.id in unplaced)
                seen_ids.add(a.id)
                unplaced.discard(a.id)
            if isinstance(a, lc.StartOn):
                assert a.id == m.id and a.worker == m.worker
        prev = m.state
        event = data.draw(events_for(m))
        launching = m.launching
        actions = m.handle(event)
        if isinstance(event, lc.NoWorker) and launching and event.id == m.id:
            unplaced.add(m.id)
        if prev is ReplicaState.STOPPED:
            assert actions == [] and m.state is ReplicaState.STOPPED
        if prev is ReplicaState.UNHEALTHY and not isinstance(event, lc.StopRequested):
            assert actions == [] and m.state is ReplicaState.UNHEALTHY
        if m.state is ReplicaState.HEALTHY:
            assert m.worker is not None
            was_healthy = True
        if m.state is ReplicaState.UNHEALTHY:
            assert m.setup_failures >= attempts or m.lost_in_setup > lost_allowed \
                or m.lost_in_probe > lost_allowed
            assert m.last_error
        if m.state is ReplicaState.RECOVERING:
            assert was_healthy  # only a replica that was healthy once recovers
        if m.state is ReplicaState.UNINITIALIZED:
            assert not was_healthy
        changes = [a for a in actions if isinstance(a, lc.StateChanged)]
        assert len(changes) <= 1
        if changes:
            assert changes[0].state is m.state is not prev
        else:
            assert m.state is prev
        launches = [a for a in actions if isinstance(a, lc.Launch)]
        assert len(launches) <= 1
        if launches:
            assert m.worker is None and m.state not in lc.TERMINAL
