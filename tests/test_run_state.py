"""The run lifecycle as a pure state machine: no cluster involved."""

from __future__ import annotations

import dask
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_services import _run_events as run_events
from dask_services import _run_model as run_model
from dask_services import _run_state as rs
from dask_services.service import (
    OutputsNotProducedError,
    ProduceKeyError,
    ServiceId,
    TooManyRestarts,
)

pytestmark = pytest.mark.timeout(60)

WORKERS = ["tcp://a:1", "tcp://b:1"]
INPUTS = ["i0", "i1", "i2"]
OUTPUTS = ["o0", "o1"]


def machine(max_restarts: int = 2) -> rs.ServiceTaskMachine:
    return rs.ServiceTaskMachine("svc", INPUTS, OUTPUTS, max_restarts)


def need(m: rs.ServiceTaskMachine, run_id: int = 1, wanted=OUTPUTS, workers=WORKERS):
    """A new run is needed; a reschedule the machine asked for is carried out first, as
    the scheduler plugin does before the released tasks lead to a new run."""
    if m.rescheduling:
        m.handle(run_events.RescheduleCarriedOut(run_id - 1))
    return m.handle(run_events.RunNeeded(run_id, "p-", workers, wanted))


def need_involved(m: rs.ServiceTaskMachine, run_id: int) -> list:
    """A run of ``participants="involved"`` wanting one output, its inputs on the first
    worker: it takes part there only."""
    if m.rescheduling:
        m.handle(run_events.RescheduleCarriedOut(run_id - 1))
    actions = m.handle(run_events.RunNeeded(run_id, "p-", WORKERS, OUTPUTS[:1],
                                    input_holders=frozenset(WORKERS[:1])))
    for a in actions:
        if isinstance(a, run_events.StartInstances):
            assert a.run.participants == tuple(WORKERS[:1])
    return actions


def kinds(actions) -> list[str]:
    return [type(a).__name__ for a in actions]


def start_all(m, run_id=1):
    out = []
    for sid in m.run.ids.values():
        out += m.handle(run_events.InstanceStarted(run_id, sid))
    return out


def test_happy_path():
    m = machine()
    actions = need(m)
    assert kinds(actions) == ["StartInstances", "Log"]
    run = actions[0].run
    assert set(run.ids) == set(WORKERS) and run.leader == run.ids[WORKERS[0]]
    assert run.owners == {"o0": run.ids[WORKERS[0]], "o1": run.ids[WORKERS[1]]}
    assert need(m, run_id=2) == []  # one live run at a time
    assert kinds(start_all(m)) == ["BroadcastAllStarted"]
    assert m.handle(run_events.InputHandedOff(1, "i0")) == []
    assert m.handle(run_events.InputHandedOff(1, "i1")) == []
    assert kinds(m.handle(run_events.InputHandedOff(1, "i2"))) == ["BroadcastInputsDone"]
    assert kinds(m.handle(run_events.OutputProduced(1, "o0", WORKERS[0]))) == ["ReleaseOutput"]
    assert kinds(m.handle(run_events.OutputProduced(1, "o1", WORKERS[1]))) == [
        "ReleaseOutput", "StopInstances", "Log",
    ]
    # the task finishes once the outputs are in memory, and it is processing somewhere
    assert m.handle(run_events.OutputLanded("o0")) == []
    assert m.handle(run_events.OutputLanded("o1")) == []
    assert kinds(m.handle(run_events.ServiceTaskProcessing(WORKERS[1]))) == ["NotifyServiceTask"]


def test_workers_in_use_are_a_live_runs_and_those_of_outputs_not_yet_in_memory():
    m = machine()
    assert m.workers_in_use() == set()
    need(m)
    assert m.workers_in_use() == set(WORKERS)  # starting
    start_all(m)
    for k in INPUTS:
        m.handle(run_events.InputHandedOff(1, k))
    assert m.workers_in_use() == set(WORKERS)  # inputs done, outputs to come
    m.handle(run_events.OutputProduced(1, "o0", WORKERS[0]))
    m.handle(run_events.OutputProduced(1, "o1", WORKERS[1]))
    assert m.run.phase is run_model.Phase.FINISHED
    assert m.workers_in_use() == set(WORKERS)  # produced, not yet claimed
    m.handle(run_events.OutputLanded("o0"))
    assert m.workers_in_use() == {WORKERS[1]}
    m.handle(run_events.OutputLanded("o1"))
    assert m.workers_in_use() == set()


def inputs_done(m, run_id=1):
    start_all(m, run_id)
    for k in INPUTS:
        m.handle(run_events.InputHandedOff(run_id, k))
    assert m.run.phase is run_model.Phase.INPUTS_DONE


def test_outputs_not_produced_once_every_hook_returned_fail_the_run():
    m = machine()
    need(m)
    inputs_done(m)
    first, second = m.run.ids.values()
    assert m.handle(run_events.HooksReturned(1, first)) == []
    assert m.handle(run_events.HooksReturned(1, first)) == []  # told twice: once counts
    m.handle(run_events.OutputProduced(1, "o0", WORKERS[0]))
    assert m.handle(run_events.HooksReturned(1, second)) == [run_events.WatchUnproduced(1, 1)]
    # no output produced meanwhile: the run fails, naming what is missing and the fix
    actions = m.handle(run_events.UnproducedChecked(1, 1))
    assert kinds(actions) == ["StopInstances", "Log", "ErrWaitingServiceTask"]
    assert m.run.phase is run_model.Phase.FAILED
    (error,) = m.pending_outcome
    assert isinstance(error, OutputsNotProducedError)
    assert "1 of the 2 wanted outputs were not produced, e.g. ['o1']" in str(error)
    assert "concierge.produce_key" in str(error)
    assert "dask_services.unproduced-timeout" in str(error)
    assert kinds(m.handle(run_events.ServiceTaskProcessing(WORKERS[0]))) == ["NotifyServiceTask"]


def test_outputs_produced_after_the_hooks_returned_keep_the_run_going():
    m = machine()
    need(m)
    inputs_done(m)
    for sid in list(m.run.ids.values()):
        actions = m.handle(run_events.HooksReturned(1, sid))
    assert actions == [run_events.WatchUnproduced(1, 0)]
    m.handle(run_events.OutputProduced(1, "o0", WORKERS[0]))
    # progress since the wait began: another wait, counted from now
    assert m.handle(run_events.UnproducedChecked(1, 0)) == [run_events.WatchUnproduced(1, 1)]
    assert kinds(m.handle(run_events.OutputProduced(1, "o1", WORKERS[1]))) == [
        "ReleaseOutput", "StopInstances", "Log"]
    # the run finished: the last wait's end changes nothing
    assert m.handle(run_events.UnproducedChecked(1, 1)) == []
    assert m.run.phase is run_model.Phase.FINISHED


def test_hooks_returned_of_another_run_or_instance_are_ignored():
    m = machine()
    need(m)
    inputs_done(m)
    assert m.handle(run_events.HooksReturned(2, ServiceId("p-1.0"))) == []
    assert m.handle(run_events.HooksReturned(1, ServiceId("p-9.0"))) == []
    assert m.handle(run_events.UnproducedChecked(2, 0)) == []
    assert m.run.returned == set() and m.run.live


def test_barrier_waits_for_all_started():
    m = machine()
    need(m)
    for k in INPUTS:
        assert m.handle(run_events.InputHandedOff(1, k)) == []
    assert kinds(start_all(m)) == ["BroadcastAllStarted", "BroadcastInputsDone"]


def test_stale_events_are_ignored_and_stale_outputs_dropped():
    m = machine()
    need(m)
    assert m.handle(run_events.InputHandedOff(7, "i0")) == []
    assert m.handle(run_events.InstanceStarted(7, ServiceId("x"))) == []
    assert m.handle(run_events.RunFailed(7, ValueError())) == []
    assert kinds(m.handle(run_events.OutputProduced(7, "o0", "w"))) == ["DropOutput"]


def test_duplicate_and_unknown_outputs_fail_the_run_unwanted_ones_are_dropped():
    m = machine()
    need(m)
    m.handle(run_events.ServiceTaskProcessing(WORKERS[0]))
    m.handle(run_events.OutputProduced(1, "o0", WORKERS[0]))
    actions = m.handle(run_events.OutputProduced(1, "o0", WORKERS[1]))
    assert kinds(actions) == ["DropOutput", "StopInstances", "Log", "NotifyServiceTask"]
    assert isinstance(actions[-1].error, ProduceKeyError)
    m2 = machine()
    need(m2, wanted=["o1"])
    # an output this run was not started for: dropped, the run goes on
    assert kinds(m2.handle(run_events.OutputProduced(1, "o0", WORKERS[0]))) == ["DropOutput"]
    assert m2.live_run is not None and m2.pending_outcome is None
    # a key that is not an output at all: the run fails
    actions = m2.handle(run_events.OutputProduced(1, "stranger", WORKERS[0]))
    assert kinds(actions) == ["DropOutput", "StopInstances", "Log", "ErrWaitingServiceTask"]
    assert "is not an output of service task" in str(m2.pending_outcome[0])


def test_restarts_then_too_many():
    m = machine(max_restarts=1)
    need(m)
    actions = m.handle(run_events.WorkerLost(WORKERS[1]))
    assert kinds(actions) == ["StopInstances", "Log", "RescheduleServiceTask"]
    assert "left the cluster" in actions[-1].reason
    assert m.run is None
    assert kinds(need(m, run_id=2, workers=WORKERS[:1])) == ["StartInstances", "Log"]
    assert m.run.ids[WORKERS[0]] != actions[0].run.ids[WORKERS[0]]  # new ids
    actions = m.handle(run_events.RestartRequested(2, "asked"))
    # the task runs nowhere: the scheduler errs it (the outcome waits should it run first)
    assert kinds(actions) == ["StopInstances", "Log", "ErrWaitingServiceTask"]
    assert isinstance(m.pending_outcome[0], TooManyRestarts)
    assert "asked" in str(m.pending_outcome[0])
    assert kinds(m.handle(run_events.ServiceTaskProcessing(WORKERS[0]))) == ["NotifyServiceTask"]


def test_a_retry_after_too_many_restarts_counts_its_own():
    """After a run failed with too many restarts (the service task errs), a new run (a
    retried task) may restart as often as a first one: one attempt's restarts end with it."""
    m = machine(max_restarts=1)
    need(m)
    m.handle(run_events.RestartRequested(1, "first"))
    need(m, run_id=2)
    m.handle(run_events.RestartRequested(2, "second"))
    assert isinstance(m.pending_outcome[0], TooManyRestarts) and m.restarts == 2
    assert kinds(m.handle(run_events.ServiceTaskProcessing(WORKERS[0]))) == ["NotifyServiceTask"]
    assert need(m, run_id=3) == []  # told to err: no run until it did
    m.handle(run_events.ServiceTaskReleased(still_wanted=True, inputs_kept=True, retried=True))
    assert m.restarts == 0
    assert m.handle(run_events.ServiceTaskProcessing(WORKERS[0])) == []  # the retry
    need(m, run_id=3)
    assert kinds(m.handle(run_events.RestartRequested(3, "third"))) == [
        "StopInstances", "Log", "RescheduleServiceTask"]  # restarted, not failed
    need(m, run_id=4)
    assert kinds(m.handle(run_events.RestartRequested(4, "fourth"))) == ["StopInstances", "Log",
                                                                  "NotifyServiceTask"]
    m.validate()


def test_wanted_grew_restarts_without_counting():
    m = machine(max_restarts=0)
    need(m, wanted=["o0"])
    actions = m.handle(run_events.WantedGrew("more outputs were asked for"))
    assert kinds(actions) == ["StopInstances", "Log", "RescheduleServiceTask"]
    assert m.restarts == 0 and m.run is None


def test_worker_not_participating_does_not_restart():
    m = machine()
    need(m)
    assert m.handle(run_events.WorkerLost("tcp://other:1")) == []


def test_a_participant_being_retired_restarts_the_live_run_at_once():
    """Not once it has left: until then the run would feed an instance whose part is lost
    with it.  Counted, as a death is; a worker outside the run, or a run already over,
    is left alone."""
    m = machine(max_restarts=1)
    need(m)
    assert m.handle(run_events.WorkerRetiring("tcp://other:1")) == []
    actions = m.handle(run_events.WorkerRetiring(WORKERS[1], stimulus_id="retire-1"))
    assert kinds(actions) == ["StopInstances", "Log", "RescheduleServiceTask"]
    assert "worker " + WORKERS[1] + " is being retired" in actions[-1].reason
    assert {a.stimulus_id for a in actions} == {"retire-1"}
    assert m.run is None and m.restarts == 1
    # it leaves later: the run it took part in is over, nothing more to do
    assert m.handle(run_events.WorkerLost(WORKERS[1])) == []
    need(m, run_id=2, workers=WORKERS[:1])
    start_all(m, run_id=2)
    for k in INPUTS:
        m.handle(run_events.InputHandedOff(2, k))
    m.handle(run_events.OutputProduced(2, "o0", WORKERS[0]))
    m.handle(run_events.OutputProduced(2, "o1", WORKERS[0]))
    assert m.run.phase is run_model.Phase.FINISHED
    assert m.handle(run_events.WorkerRetiring(WORKERS[0])) == []  # finished: nothing live
    # retired again and again, faster than a run finishes: a clear error, not endless runs
    m2 = machine(max_restarts=1)
    need(m2)
    m2.handle(run_events.WorkerRetiring(WORKERS[0]))
    need(m2, run_id=2, workers=WORKERS[1:])
    actions = m2.handle(run_events.WorkerRetiring(WORKERS[1]))
    assert kinds(actions) == ["StopInstances", "Log", "ErrWaitingServiceTask"]
    assert isinstance(m2.pending_outcome[0], TooManyRestarts)
    assert "is being retired" in str(m2.pending_outcome[0])
    m.validate()
    m2.validate()


def test_the_worker_that_took_an_input_is_that_of_its_instance_in_the_live_run():
    """Where a hand-off run again goes: its instance ignores an input it took."""
    m = machine()
    assert m.worker_that_took("i0") is None  # no run
    need(m)
    start_all(m)
    ids = m.run.ids
    assert m.handle(run_events.InputHandedOff(1, "i0", ids[WORKERS[1]])) == []
    assert m.handle(run_events.InputHandedOff(1, "i1")) == []  # no instance named
    assert m.worker_that_took("i0") == WORKERS[1]
    assert m.worker_that_took("i1") is None and m.worker_that_took("i2") is None
    m.handle(run_events.WorkerLost(WORKERS[1]))  # restarted: no live run
    assert m.worker_that_took("i0") is None


def test_an_input_taken_by_two_instances_restarts_the_run_by_one_it_does_not():
    m = machine()
    need(m)
    start_all(m)
    a, b = m.run.ids.values()
    assert m.handle(run_events.InputHandedOff(1, "i0", a)) == []
    assert m.handle(run_events.InputHandedOff(1, "i0", a)) == []  # the same instance
    assert m.handle(run_events.InputHandedOff(1, "i1")) == []  # no instance named
    actions = m.handle(run_events.InputHandedOff(1, "i0", b))
    assert kinds(actions) == ["StopInstances", "Log", "RescheduleServiceTask"]
    assert f"taken by two instances, {a} and {b}" in actions[1].detail
    # the next run starts afresh
    need(m, run_id=2)
    start_all(m, run_id=2)
    c, d = m.run.ids.values()
    assert m.handle(run_events.InputHandedOff(2, "i0", d)) == []
    assert m.run.handed_off == {"i0"}


def test_cancel_and_task_worker_lost():
    m = machine()
    need(m)
    m.handle(run_events.ServiceTaskProcessing(WORKERS[0]))
    stop, log = m.handle(run_events.ServiceTaskReleased())
    assert (type(stop), type(log)) == (run_events.StopInstances, run_events.Log)
    # the status says why, and how far the run got (its detail was empty)
    assert log.action == "cancelled" and log.detail == stop.reason == (
        f"nothing wants its outputs any more (0 of {len(stop.run.wanted)} produced)")
    assert m.run is None and m.restarts == 0
    need(m, run_id=2)
    m.handle(run_events.ServiceTaskProcessing(WORKERS[0]))
    actions = m.handle(run_events.ServiceTaskReleased(worker_gone=True))
    assert kinds(actions) == ["StopInstances", "Log", "RescheduleServiceTask"]
    assert m.restarts == 1
    # released but still wanted (a receipt it needed was lost): restart, not cancel
    need(m, run_id=3)
    actions = m.handle(run_events.ServiceTaskReleased(still_wanted=True))
    assert kinds(actions) == ["StopInstances", "Log", "RescheduleServiceTask"]
    assert "input it had received was lost" in actions[-1].reason


def test_a_service_task_released_with_every_input_kept_leaves_its_run_going():
    """distributed releases a task over a result of a stale execution (cancelled by a
    restart, then taken up again by its worker): the live run goes on, and its outcome
    goes to wherever the task runs next."""
    m = machine()
    need(m)
    start_all(m)
    for k in INPUTS:
        m.handle(run_events.InputHandedOff(1, k))
    m.handle(run_events.ServiceTaskProcessing(WORKERS[1]))
    assert m.handle(run_events.ServiceTaskReleased(still_wanted=True, inputs_kept=True)) == []
    assert m.run.live and m.restarts == 0 and m.task_worker is None
    m.handle(run_events.OutputProduced(1, "o0", WORKERS[0]))
    m.handle(run_events.OutputProduced(1, "o1", WORKERS[1]))
    m.handle(run_events.OutputLanded("o0"))
    assert m.handle(run_events.OutputLanded("o1")) == []  # the outcome waits for the task
    assert m.handle(run_events.ServiceTaskProcessing(WORKERS[0])) == [
        run_events.NotifyServiceTask(WORKERS[0], None)]
    # its worker gone, or a receipt lost: a restart as before
    m2 = machine()
    need(m2)
    m2.handle(run_events.ServiceTaskProcessing(WORKERS[1]))
    actions = m2.handle(run_events.ServiceTaskReleased(worker_gone=True, still_wanted=True,
                                               inputs_kept=True))
    assert kinds(actions) == ["StopInstances", "Log", "RescheduleServiceTask"]


def test_no_run_without_workers_or_with_graph_error():
    m = machine()
    assert need(m, workers=[]) == []
    m.graph_error = ValueError("bad graph")
    assert need(m) == []


EVENTS = st.one_of(
    st.builds(run_events.InstanceStarted, st.integers(1, 3), st.sampled_from(
        [ServiceId(f"p-{r}.{i}") for r in range(1, 4) for i in range(2)])),
    st.builds(run_events.InputHandedOff, st.integers(1, 3), st.sampled_from(INPUTS),
              st.sampled_from([None] + [ServiceId(f"p-{r}.{i}") for r in range(1, 4)
                                        for i in range(2)])),
    st.builds(run_events.HandOffScheduled, st.sampled_from(["h0", "h1"])),
    st.builds(run_events.OutputProduced, st.integers(1, 3), st.sampled_from(OUTPUTS + ["zz"]),
              st.sampled_from(WORKERS)),
    st.builds(run_events.OutputLanded, st.sampled_from(OUTPUTS)),
    st.builds(run_events.HooksReturned, st.integers(1, 3), st.sampled_from(
        [ServiceId(f"p-{r}.{i}") for r in range(1, 4) for i in range(2)])),
    st.builds(run_events.UnproducedChecked, st.integers(1, 3), st.integers(0, 2)),
    st.builds(run_events.RunFailed, st.integers(1, 3), st.just(ValueError("x"))),
    st.builds(run_events.RestartRequested, st.integers(1, 3), st.just("r")),
    st.builds(run_events.WorkerLost, st.sampled_from(WORKERS)),
    st.builds(run_events.WorkerRetiring, st.sampled_from(WORKERS)),
    st.builds(run_events.ServiceTaskProcessing, st.sampled_from(WORKERS)),
    st.builds(run_events.ServiceTaskReleased, st.booleans(), st.booleans(), st.booleans()),
    st.builds(run_events.RescheduleCarriedOut, st.integers(1, 3)),
    st.just("need"),
    st.just("need-involved"),  # one output, inputs on one worker: a run on that one only
)


@settings(max_examples=300, deadline=None)
@given(st.lists(EVENTS, max_size=40))
def test_invariants_under_any_event_order(events):
    """Every started run is stopped at most once; outcomes go out at most once per run."""
    m = machine()
    run_id = 0
    starts, stops, notified = set(), [], []
    for ev in events:
        if ev == "need":
            run_id += 1
            actions = need(m, run_id=run_id)
        elif ev == "need-involved":
            run_id += 1
            actions = need_involved(m, run_id)
        else:
            actions = m.handle(ev)
        for a in actions:
            if isinstance(a, run_events.StartInstances):
                assert a.run.run_id not in starts
                starts.add(a.run.run_id)
            elif isinstance(a, run_events.StopInstances):
                stops.append(a.run.run_id)
            elif isinstance(a, run_events.NotifyServiceTask):
                notified.append(a)
        assert len(stops) == len(set(stops)), "a run was stopped twice"
        assert set(stops) <= starts
        live = m.live_run
        if live is not None:
            assert live.run_id not in stops
            assert set(live.produced) <= set(live.wanted)
    assert m.restarts <= m.max_restarts + 1


@given(
    wanted=st.integers(0, 40),
    workers=st.integers(1, 5),
    placed=st.dictionaries(st.integers(0, 39), st.sampled_from(["w0", "w1", "w2", "gone"]),
                           max_size=40),
)
def test_owners_keep_placement_and_balance_the_rest(wanted, workers, placed):
    keys = [("o", i) for i in range(wanted)]
    participants = [f"w{i}" for i in range(workers)]
    placement = {("o", i): w for i, w in placed.items()}
    owners = rs._owners(keys, participants, placement)
    assert list(owners) == keys
    assert set(owners.values()) <= set(participants)
    kept = {k: w for k, w in placement.items() if k in owners and w in participants}
    assert all(owners[k] == w for k, w in kept.items())
    if not kept:  # nothing placed: round-robin, as always
        assert [owners[k] for k in keys] == [participants[i % workers] for i in range(wanted)]
    else:  # the others fill up the least-loaded workers first
        counts = {w: list(owners.values()).count(w) for w in participants}
        placed_on = {w: list(kept.values()).count(w) for w in participants}
        least = min(counts.values())
        for w in participants:
            if counts[w] > placed_on[w]:  # it took outputs that had no place
                assert counts[w] <= least + 1, (counts, placed_on)


@given(wanted=st.integers(0, 40), workers=st.integers(1, 5), first=st.integers(0, 100))
def test_owners_round_robin_from_the_first_owner_given(wanted, workers, first):
    keys = [("o", i) for i in range(wanted)]
    participants = [f"w{i}" for i in range(workers)]
    owners = rs._owners(keys, participants, {}, first)
    assert [owners[k] for k in keys] == [participants[(first + i) % workers]
                                         for i in range(wanted)]


def test_runs_one_after_the_other_spread_their_outputs():
    """The first owner each run is given carries on from the last run's outputs: ten runs
    of four outputs on five workers own eight each (each starting at the first: 16, 8,
    8, 8, 0)."""
    participants = [f"w{i}" for i in range(5)]
    counts = dict.fromkeys(participants, 0)
    next_owner = 0
    for r in range(10):
        keys = [("o", r, i) for i in range(4)]
        m = rs.ServiceTaskMachine(f"svc{r}", INPUTS, keys, 2)
        (start, _log) = m.handle(run_events.RunNeeded(1, "p-", participants, keys,
                                              first_owner=next_owner % 5))
        next_owner += len(keys)
        worker_of = {sid: w for w, sid in start.run.ids.items()}
        for sid in start.run.owners.values():
            counts[worker_of[sid]] += 1
    assert list(counts.values()) == [8] * 5


@given(
    outputs=st.integers(0, 8),
    workers=st.integers(1, 6),
    holders=st.integers(1, 6),
    placed=st.dictionaries(st.integers(0, 7), st.integers(0, 5), max_size=8),
)
def test_involved_runs_leave_out_workers_without_inputs_or_outputs(outputs, workers,
                                                                   holders, placed):
    """``input_holders`` given (``participants="involved"``, every input located): the run
    takes part on the holders and the outputs' owners only, in the order given, and owns
    its outputs where ``_owners`` would have put them among all the workers."""
    keys = [f"o{i}" for i in range(outputs)]
    everyone = [f"tcp://w{i}:1" for i in range(workers)]
    holding = frozenset(everyone[:min(holders, workers)])
    placement = {keys[i]: everyone[w % workers] for i, w in placed.items() if i < outputs}
    m = rs.ServiceTaskMachine("svc", INPUTS, keys, 2)
    (start, _log) = m.handle(run_events.RunNeeded(1, "p-", everyone, keys, placement,
                                          input_holders=holding))
    run = start.run
    expected = rs._owners(keys, everyone, placement)
    involved = holding | set(expected.values())
    assert list(run.participants) == [w for w in everyone if w in involved]
    worker_of = {sid: w for w, sid in run.ids.items()}
    assert {k: worker_of[sid] for k, sid in run.owners.items()} == expected
    assert run.leader == run.ids[run.participants[0]]
    m.validate()


# ------------------------------------------------------------------ a closed machine


@settings(max_examples=200, deadline=None)
@given(st.lists(EVENTS, max_size=40))
def test_validate_holds_after_any_event(events):
    """``validate()`` runs after every event of a validating machine and never fails."""
    m = rs.ServiceTaskMachine("svc", INPUTS, OUTPUTS, 2, validating=True)
    run_id = 0
    for ev in events:
        if ev == "need":
            run_id += 1
            need(m, run_id=run_id)
        elif ev == "need-involved":
            run_id += 1
            need_involved(m, run_id)
        else:
            m.handle(ev)
    m.validate()


def test_unknown_events_and_actions_raise():
    m = machine()
    with pytest.raises(TypeError, match="no handler"):
        m.handle(object())  # type: ignore[arg-type]
    from dask_services.scheduler import ServiceSchedulerPlugin

    with pytest.raises(TypeError, match="no way to carry out"):
        ServiceSchedulerPlugin()._apply("svc", [object()])  # type: ignore[list-item]


def test_actions_carry_snapshots_and_the_stimulus_of_their_event():
    m = machine()
    actions = m.handle(run_events.RunNeeded(1, "p-", WORKERS, OUTPUTS, stimulus_id="s-1"))
    start = actions[0]
    assert isinstance(start.run, run_model.RunSnapshot) and start.run is not m.run
    assert all(a.stimulus_id == "s-1" for a in actions)
    with pytest.raises(TypeError):
        start.run.ids["tcp://c:1"] = "x"  # read-only
    start_all(m)
    assert start.run.phase is run_model.Phase.STARTING  # the snapshot did not move on
    assert m.run.phase is run_model.Phase.RUNNING


def test_story_tells_what_was_received_decided_and_sent():
    m = machine()
    m.handle(run_events.HandOffScheduled("h0", stimulus_id="h"))
    need(m)
    m.handle(run_events.WorkerLost(WORKERS[1], stimulus_id="gone"))
    story = [(e.run_id, e.kind, e.what if isinstance(e.what, str) else type(e.what).__name__)
             for e in m.story()]
    assert story[:2] == [(None, "received", "HandOffScheduled"), (None, "sent", "PrepareRun")]
    assert (1, "decided", "run 1 created") in story
    lost = story.index((1, "received", "WorkerLost"))
    assert story[lost + 1:] == [(1, "decided", "run 1 is over"),
                                (1, "decided", "restarts: 0 -> 1"),
                                (1, "sent", "StopInstances"), (1, "sent", "Log"),
                                (1, "sent", "RescheduleServiceTask")]
    assert {e.stimulus_id for e in m.story(1) if e.seq >= m.story(1)[-1].seq - 5} == {"gone"}
    assert [e.as_dict()["what"] for e in m.story(1)][-1] == "RescheduleServiceTask"


def test_stories_are_bounded():
    with dask.config.set({"dask_services.story.entries": 3, "dask_services.story.runs": 2}):
        m = machine(max_restarts=10)
    for run_id in range(1, 5):
        need(m, run_id=run_id)
        for k in INPUTS:
            m.handle(run_events.InputHandedOff(run_id, k))
        m.handle(run_events.RestartRequested(run_id, "again"))
    assert list(m.stories) == [3, 4]
    assert all(len(s.milestones) <= 3 and len(s.routine) <= 3 for s in m.stories.values())
    m.validate()


def test_one_lost_worker_costs_one_restart_of_a_task_without_inputs():
    """The worker running a service task without inputs dies: the scheduler places the task
    on another worker at once, before the plugin carries out the reschedule; no run may
    start then, or the reschedule's release of the task restarts it once more, and again,
    until TooManyRestarts."""
    m = rs.ServiceTaskMachine("svc", [], OUTPUTS, max_restarts=3)
    assert kinds(m.handle(run_events.ServiceTaskProcessing(WORKERS[0]))) == ["PrepareRun"]
    need(m)
    start_all(m)
    m.handle(run_events.ServiceTaskReleased(worker_gone=True, still_wanted=True))
    assert m.restarts == 1 and m.run is None and m.rescheduling
    assert m.handle(run_events.ServiceTaskProcessing(WORKERS[1])) == []  # placed again: waits
    assert m.handle(run_events.RunNeeded(2, "p-", WORKERS[1:], OUTPUTS)) == []
    m.handle(run_events.RescheduleCarriedOut(1))
    # the reschedule releases the task (no live run: nothing to restart), then it runs
    assert m.handle(run_events.ServiceTaskReleased(worker_gone=False, still_wanted=True)) == []
    assert kinds(m.handle(run_events.ServiceTaskProcessing(WORKERS[1]))) == ["PrepareRun"]
    assert kinds(need(m, run_id=2, workers=WORKERS[1:])) == ["StartInstances", "Log"]
    assert m.restarts == 1
    m.validate()


def test_a_finished_run_whose_task_is_lost_before_memory_hands_off_again():
    """The run finished and its outputs landed, but the worker running the service task
    died before the task reached memory: a new run will need every input, so the hand-offs
    that survived (their inputs went to the finished run) must run again."""
    m = machine()
    need(m)
    start_all(m)
    for k in INPUTS:
        m.handle(run_events.InputHandedOff(1, k))
    m.handle(run_events.OutputProduced(1, "o0", WORKERS[0]))
    m.handle(run_events.OutputProduced(1, "o1", WORKERS[1]))
    m.handle(run_events.OutputLanded("o0"))
    m.handle(run_events.OutputLanded("o1"))
    assert kinds(m.handle(run_events.ServiceTaskProcessing(WORKERS[0]))) == ["NotifyServiceTask"]
    assert m.handle(run_events.WorkerLost(WORKERS[0])) == []  # the run is over already
    actions = m.handle(run_events.ServiceTaskReleased(worker_gone=True, still_wanted=True))
    assert kinds(actions) == ["RescheduleServiceTask"]
    assert m.run is None and m.restarts == 0
    assert kinds(need(m, run_id=2, wanted=["o0"])) == ["StartInstances", "Log"]


def test_a_failed_run_whose_task_is_retried_hands_off_again():
    """``retries=``: the run failed, the scheduler released the service task (instead of
    erring it) and will run it again; its hand-offs gave their inputs to the failed run,
    so they run again too, or the next run waits for them for ever."""
    m = machine()
    assert m.handle(run_events.ServiceTaskProcessing(WORKERS[0])) == []
    need(m)
    start_all(m)
    for k in INPUTS:
        m.handle(run_events.InputHandedOff(1, k))
    assert kinds(m.handle(run_events.RunFailed(1, ValueError("boom")))) == [
        "StopInstances", "Log", "NotifyServiceTask"]
    actions = m.handle(run_events.ServiceTaskReleased(still_wanted=True, inputs_kept=True,
                                              retried=True))
    assert kinds(actions) == ["RescheduleServiceTask"]
    assert "retried after its run failed" in actions[0].reason
    assert m.run is None and m.rescheduling
    assert m.handle(run_events.ServiceTaskProcessing(WORKERS[1])) == []
    assert kinds(need(m, run_id=2)) == ["StartInstances", "Log"]
    m.validate()


def failed_while_waiting() -> rs.ServiceTaskMachine:
    """A machine whose first run failed while its service task ran nowhere."""
    m = machine()
    need(m)
    start_all(m)
    m.handle(run_events.RunFailed(1, ValueError("boom")))
    return m


def test_a_failed_run_whose_task_is_released_unwanted_does_nothing_more():
    m = failed_while_waiting()
    assert m.handle(run_events.ServiceTaskReleased()) == []
    assert m.run is None and not m.rescheduling


def test_a_finished_run_whose_task_is_cancelled_before_memory_does_nothing_more():
    m = machine()
    need(m)
    start_all(m)
    for k in INPUTS:
        m.handle(run_events.InputHandedOff(1, k))
    m.handle(run_events.OutputProduced(1, "o0", WORKERS[0]))
    m.handle(run_events.OutputProduced(1, "o1", WORKERS[1]))
    assert m.handle(run_events.ServiceTaskReleased()) == []
    assert m.run is None


def finish(m: rs.ServiceTaskMachine, run_id: int) -> None:
    """Run ``run_id`` to the end: every input handed off, every output produced and
    landed, the service task in memory."""
    start_all(m, run_id)
    for k in INPUTS:
        m.handle(run_events.InputHandedOff(run_id, k))
    for o, w in zip(OUTPUTS, WORKERS, strict=True):
        m.handle(run_events.OutputProduced(run_id, o, w))
        m.handle(run_events.OutputLanded(o))
    assert kinds(m.handle(run_events.ServiceTaskProcessing(WORKERS[0]))) == ["NotifyServiceTask"]
    assert m.handle(run_events.ServiceTaskDone()) == []


def test_outputs_lost_again_and_again_after_finishing_end_in_too_many_restarts():
    """A run finishes, then a worker holding an output dies (its nanny killed it over
    memory, say), a new run produces it there again, and the worker dies again: each run
    finishing must not start the count afresh, or this goes on for ever."""
    m = machine(max_restarts=1)
    need(m)
    finish(m, 1)
    assert m.handle(run_events.WorkerLost(WORKERS[1])) == []  # nothing live: the next run counts
    _, log = need(m, run_id=2)
    assert m.restarts == 1
    # its start says why it runs, and that it counts (no run ended "restarted")
    assert log.action == "started" and log.detail == (
        f"on 2 workers, again: worker {WORKERS[1]} left the cluster after the run had "
        "finished, with what it held (counted as a restart)")
    finish(m, 2)
    m.handle(run_events.WorkerLost(WORKERS[1]))
    m.handle(run_events.ServiceTaskProcessing(WORKERS[0]))
    actions = need(m, run_id=3)
    assert kinds(actions) == ["NotifyServiceTask"] and m.run is None
    assert isinstance(actions[0].error, TooManyRestarts)
    assert "after the run had finished" in str(actions[0].error)
    assert "memory limit" in str(actions[0].error)
    m.validate()


def test_a_new_run_after_finishing_without_a_loss_is_not_a_restart():
    """A second compute asks for outputs the first did not want: a new run, no restart."""
    m = machine(max_restarts=0)
    need(m, wanted=OUTPUTS)
    finish(m, 1)
    assert m.handle(run_events.WorkerLost("tcp://other:1")) == []  # not one of the run's workers
    assert kinds(need(m, run_id=2)) == ["StartInstances", "Log"]
    assert m.restarts == 0
    m.validate()


def test_the_scheduler_erring_the_task_mid_run_stops_its_instances():
    """distributed errs a service task whose workers kept dying while it waited
    (``KilledWorker``): the live run's instances stop, and a retry counts afresh."""
    m = machine(max_restarts=2)
    need(m)
    start_all(m)
    m.handle(run_events.RestartRequested(1, "asked"))
    need(m, run_id=2)
    start_all(m, 2)
    assert m.restarts == 1
    actions = m.handle(run_events.ServiceTaskDone(erred=True))
    assert kinds(actions) == ["StopInstances", "Log"]
    assert actions[0].run.run_id == 2 and m.run is None and m.restarts == 2  # counted
    assert m.handle(run_events.WorkerLost(WORKERS[0])) == []
    # distributed runs an erred task again when an input it had is lost and recomputed
    assert kinds(need(m, run_id=3)) == ["StartInstances", "Log"]
    m.handle(run_events.ServiceTaskDone(erred=True))
    # used up: errs again
    assert kinds(need(m, run_id=4)) == ["ErrWaitingServiceTask"] and m.live_run is None
    assert isinstance(m.pending_outcome[0], TooManyRestarts)
    assert "KilledWorker" in str(m.pending_outcome[0])
    m.validate()


def test_a_task_erred_with_too_many_restarts_and_run_again_errs_again():
    """distributed runs an erred service task again when one of its inputs is lost and
    recomputed; after TooManyRestarts that started the losses again, from none."""
    m = machine(max_restarts=0)
    m.handle(run_events.ServiceTaskProcessing(WORKERS[0]))
    need(m)
    assert kinds(m.handle(run_events.WorkerLost(WORKERS[1]))) == [
        "StopInstances", "Log", "NotifyServiceTask"]
    m.handle(run_events.ServiceTaskDone(erred=True))
    m.handle(run_events.ServiceTaskProcessing(WORKERS[0]))  # run again by distributed
    actions = need(m, run_id=2)
    assert kinds(actions) == ["NotifyServiceTask"] and m.live_run is None
    assert isinstance(actions[0].error, TooManyRestarts)
    m.validate()


def test_an_error_taken_by_a_stale_execution_reaches_the_next_one():
    """The service task is told to err, but an execution of it that a restart had
    cancelled takes the error (the scheduler releases the task over its stale answer and
    runs it again): the next execution errs with it, no new run starts (one did, with the
    restarts counted from none, so TooManyRestarts never reached the client)."""
    m = machine(max_restarts=0)
    assert m.handle(run_events.ServiceTaskProcessing(WORKERS[0])) == []
    need(m)
    start_all(m)
    assert kinds(m.handle(run_events.WorkerLost(WORKERS[1]))) == [
        "StopInstances", "Log", "NotifyServiceTask"]
    m.handle(run_events.ServiceTaskReleased(still_wanted=True, inputs_kept=True))  # stale answer
    assert m.live_run is None and not m.rescheduling
    actions = m.handle(run_events.ServiceTaskProcessing(WORKERS[0]))
    assert kinds(actions) == ["NotifyServiceTask"]
    assert isinstance(actions[0].error, TooManyRestarts)
    assert need(m, run_id=2) == []
    m.handle(run_events.ServiceTaskDone(erred=True))
    assert m.failure is None
    m.validate()


@pytest.mark.parametrize("fails", [True, False])
def test_an_outcome_goes_again_to_a_service_task_moved_without_a_transition(fails):
    """Work stealing moves a task from one worker's queue to another's without a
    transition the plugin sees: the outcome went to the first worker, which dropped it
    with the task, and the service task waited on the second for ever.  Its execution
    there says so (``ServiceTaskExecuting``), and it gets the outcome decided."""
    m = machine()
    assert m.handle(run_events.ServiceTaskProcessing(WORKERS[0])) == []
    need(m)
    start_all(m)
    for k in INPUTS:
        m.handle(run_events.InputHandedOff(1, k))
    if fails:
        told = m.handle(run_events.RunFailed(1, ValueError("boom")))
    else:
        m.handle(run_events.OutputProduced(1, "o0", WORKERS[0]))
        m.handle(run_events.OutputProduced(1, "o1", WORKERS[1]))
        m.handle(run_events.OutputLanded("o0"))
        told = m.handle(run_events.OutputLanded("o1"))
    (first,) = [a for a in told if isinstance(a, run_events.NotifyServiceTask)]
    assert first.worker == WORKERS[0]
    # an execution where the outcome went: nothing more to say
    assert m.handle(run_events.ServiceTaskExecuting(WORKERS[0])) == []
    (again,) = m.handle(run_events.ServiceTaskExecuting(WORKERS[1]))
    assert isinstance(again, run_events.NotifyServiceTask) and again.worker == WORKERS[1]
    assert (again.error is first.error) if fails else again.error is None
    assert m.handle(run_events.ServiceTaskExecuting(WORKERS[1])) == []  # told once
    m.validate()


def test_a_service_task_moved_while_its_run_goes_on_gets_the_outcome_where_it_waits():
    m = machine()
    m.handle(run_events.ServiceTaskProcessing(WORKERS[0]))
    need(m)
    start_all(m)
    assert m.handle(run_events.ServiceTaskExecuting(WORKERS[1])) == []  # nothing decided
    told = m.handle(run_events.RunFailed(1, ValueError("boom")))
    (notify,) = [a for a in told if isinstance(a, run_events.NotifyServiceTask)]
    assert notify.worker == WORKERS[1]
    m.validate()


def test_a_run_failing_while_its_service_task_waits_asks_to_err_it_at_once():
    """The run started as the first inputs were handed off and failed while its service
    task still waits for others: no worker runs the task to raise the error, so the
    scheduler is asked to err it now; the error stays pending for wherever the task runs
    should it run first."""
    m = machine()
    need(m)
    start_all(m)
    m.handle(run_events.InputHandedOff(1, "i0"))
    error = ValueError("boom")
    actions = m.handle(run_events.RunFailed(1, error))
    assert kinds(actions) == ["StopInstances", "Log", "ErrWaitingServiceTask"]
    assert actions[-1].error is error
    m.validate()
    (told,) = m.handle(run_events.ServiceTaskProcessing(WORKERS[1]))
    assert isinstance(told, run_events.NotifyServiceTask) and told.error is error
    m.validate()


def test_a_service_task_erred_while_it_waits_is_done():
    m = failed_while_waiting()
    assert m.handle(run_events.ServiceTaskDone(erred=True)) == []
    assert m.pending_outcome is None and m.failure is None
    assert m.handle(run_events.ServiceTaskProcessing(WORKERS[0])) == []  # told nothing
    m.validate()


@pytest.mark.parametrize("error", [ValueError("boom"), None])
def test_an_outcome_undelivered_to_a_task_that_runs_nowhere(error):
    m = machine()
    m.handle(run_events.ServiceTaskProcessing(WORKERS[0]))
    need(m)
    start_all(m)
    actions = m.handle(run_events.OutcomeUndelivered(error, None))
    if error is None:
        assert actions == []
    else:
        assert kinds(actions) == ["ErrWaitingServiceTask"] and actions[0].error is error
    assert m.pending_outcome == (error,)
    m.validate()
