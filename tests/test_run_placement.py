"""Where a run takes place (``_run_placement``), without a cluster: plain objects stand in
for the scheduler's task states, with the attributes the functions read."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_services._run_placement import (
    PlacementGroup,
    input_holders,
    near_inputs,
    participants,
    with_resources,
)

pytestmark = pytest.mark.timeout(60)


def worker(address):
    return SimpleNamespace(address=address)


def in_memory(*addresses):
    return SimpleNamespace(state="memory", who_has=[worker(a) for a in addresses],
                           processing_on=None)


def processing(address):
    return SimpleNamespace(state="processing", who_has=None, processing_on=worker(address))


def service_task(restrictions=None, loose=False):
    return SimpleNamespace(worker_restrictions=restrictions, loose_restrictions=loose)


RUNNING = {"w1", "w2", "w3", "w4"}


def test_input_holders_counts_memory_and_processing_inputs():
    tasks = {"a": in_memory("w1", "w2"), "b": processing("w3"), "c": in_memory("w9")}
    assert input_holders(tasks, ["a", "b", "c"], RUNNING) == {"w1", "w2", "w3"}


@pytest.mark.parametrize("missing", [
    pytest.param({}, id="unknown input"),
    pytest.param({"b": SimpleNamespace(state="memory", who_has=None, processing_on=None)},
                 id="in memory without holder (lost with a worker)"),
    pytest.param({"b": SimpleNamespace(state="waiting", who_has=set(), processing_on=None)},
                 id="not computed yet"),
])
def test_an_input_without_a_worker_leaves_no_holders(missing):
    tasks = {"a": in_memory("w1"), **missing}
    assert input_holders(tasks, ["a", "b"], RUNNING) == set()


def test_every_running_worker_takes_part_in_order_by_default():
    tasks = {"a": in_memory("w3")}
    assert participants(service_task(), RUNNING, "all", ["a"], tasks) == (
        ["w1", "w2", "w3", "w4"], None)


def test_input_holders_mode_narrows_to_holders_unless_an_input_has_none():
    tasks = {"a": in_memory("w3"), "b": processing("w2")}
    assert participants(service_task(), RUNNING, "input-holders", ["a", "b"], tasks) == (
        ["w2", "w3"], None)
    assert participants(service_task(), RUNNING, "input-holders", ["a", "x"], tasks) == (
        ["w1", "w2", "w3", "w4"], None)


def test_involved_puts_holders_first_and_names_them():
    tasks = {"a": in_memory("w4"), "b": in_memory("w2")}
    assert participants(service_task(), RUNNING, "involved", ["a", "b"], tasks) == (
        ["w2", "w4", "w1", "w3"], frozenset({"w2", "w4"}))


def test_restrictions_narrow_the_workers_loose_ones_only_while_one_runs():
    tasks = {"a": in_memory("w1")}
    strict = service_task(restrictions={"w2", "w9"})
    assert participants(strict, RUNNING, "all", ["a"], tasks) == (["w2"], None)
    assert participants(service_task({"w9"}), RUNNING, "all", ["a"], tasks) == ([], None)
    loose = service_task(restrictions={"w9"}, loose=True)
    assert participants(loose, RUNNING, "all", ["a"], tasks)[0] == sorted(RUNNING)


def test_near_inputs_keeps_outputs_next_to_their_inputs_within_a_share():
    tasks = {f"i{n}": in_memory("w1") for n in range(6)}
    tasks["lost"] = SimpleNamespace(state="memory", who_has=None, processing_on=None)
    affinity = {f"o{n}": f"i{n}" for n in range(6)} | {"o6": "lost", "o7": "gone"}
    placed = near_inputs(tasks, affinity, ["w1", "w2"])
    # 8 outputs over 2 workers: a share of 4, plus one
    assert list(placed.values()) == ["w1"] * 5
    assert "o6" not in placed and "o7" not in placed


def test_near_inputs_picks_the_least_address_among_holders():
    tasks = {"i": in_memory("w3", "w2")}
    assert near_inputs(tasks, {"o": "i"}, ["w2", "w3"]) == {"o": "w2"}


def test_a_placement_group_agrees_across_runs_and_remaps_only_departed_workers():
    group = PlacementGroup(start=1)
    outputs = ["x0", "x1", "x2", "x3"]
    first = group.place(outputs, ["w1", "w2", "w3"], RUNNING)
    assert first == {"x0": "w2", "x1": "w3", "x2": "w1", "x3": "w2"}
    # a run without w3 places x1 among its own participants for itself alone
    narrow = group.place(outputs, ["w1", "w2"], RUNNING)
    assert narrow["x1"] == "w1" and group.by_index[1] == "w3"  # ((1 + 1) % 2), for once
    assert group.place(outputs, ["w1", "w2", "w3"], RUNNING) == first
    # w3 left the cluster: its indices are mapped again, for good
    again = group.place(outputs, ["w1", "w2"], RUNNING - {"w3"})
    assert group.by_index[1] == again["x1"] != "w3"
    assert {k: v for k, v in again.items() if k != "x1"} == {
        k: v for k, v in first.items() if k != "x1"}


@settings(max_examples=50, deadline=None)
@given(start=st.integers(0, 50), n_outputs=st.integers(0, 40),
       workers=st.lists(st.sampled_from(sorted(RUNNING)), min_size=1, unique=True),
       later=st.lists(st.sampled_from(sorted(RUNNING)), min_size=1, unique=True))
def test_a_placement_group_places_every_output_on_a_participant(start, n_outputs, workers,
                                                                later):
    group = PlacementGroup(start=start)
    outputs = [f"o{i}" for i in range(n_outputs)]
    for run in (workers, later, workers):
        placed = group.place(outputs, sorted(run), RUNNING)
        assert list(placed) == outputs
        assert set(placed.values()) <= set(run)
    assert group.place(outputs, sorted(workers), RUNNING) == placed


def test_outputs_whose_claims_need_resources_go_where_they_are():
    """A consumer run in its output's claim keeps its resources: the output goes to a
    participant that has them, in turn; one no participant has them for is named."""
    workers = {"w1": SimpleNamespace(resources={"GPU": 1}), "w2": SimpleNamespace(resources={}),
               "w3": SimpleNamespace(resources={"GPU": 2, "FPGA": 1})}
    needs = {"a": {"GPU": 1}, "b": {"GPU": 1}, "c": {"GPU": 2}, "d": None, "e": {"TPU": 1}}
    tasks = {k: SimpleNamespace(resource_restrictions=v) for k, v in needs.items()}
    places, lacking = with_resources(tasks, list(needs), ["w1", "w2", "w3"], workers,
                                     {"a": "w2", "d": "w2"})
    assert places["a"] in ("w1", "w3") and places["b"] in ("w1", "w3")
    assert places["a"] != places["b"]  # spread
    assert places["c"] == "w3" and places["d"] == "w2" and "e" not in places
    assert lacking == ["e"]
    # nothing needing resources: the placement as it was
    assert with_resources(tasks, ["d"], ["w1"], workers, None) == (None, [])
