"""Where a run takes place: which workers take part, and which of them makes each output.

Functions of the scheduler's task and worker states (read, never changed), used by the
scheduler plugin when it prepares a run (``PrepareRun``).  They take the ``tasks`` mapping
and worker addresses rather than the scheduler, so the tests drive them with plain objects
that have the few attributes of distributed's ``TaskState`` they read: ``state``,
``who_has`` (workers with an ``address``), ``processing_on``, ``worker_restrictions`` and
``loose_restrictions``.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dask.typing import Key

__all__ = ["PlacementGroup", "input_holders", "near_inputs", "owned_as_the_service_says",
           "participants"]

logger = logging.getLogger("dask_services")


def participants(service_ts: Any, running: Collection[str], mode: str,
                 input_keys: Sequence[Key], tasks: Mapping[Key, Any]
                 ) -> tuple[list[str], frozenset[str] | None]:
    """The workers a run of ``service_ts`` may take part on, in placement order, and for
    ``participants="involved"`` the input holders among them (``None`` while an input has
    no worker: then every one takes part).

    ``running`` are the workers running tasks.  The service task's own worker
    restrictions narrow them (loose ones only while a restricted worker runs);
    ``"input-holders"`` narrows them to the workers holding or computing an input, where
    every input has one; ``"involved"`` puts those first."""
    running = set(running)
    if service_ts.worker_restrictions:
        restricted = running & set(service_ts.worker_restrictions)
        if restricted or not service_ts.loose_restrictions:
            running = restricted
    if mode == "input-holders":
        running = input_holders(tasks, input_keys, running) or running
    elif mode == "involved":
        holders = input_holders(tasks, input_keys, running)
        if holders:  # outputs go to the input holders first: fewer workers take part
            return sorted(holders) + sorted(running - holders), frozenset(holders)
    return sorted(running), None


def input_holders(tasks: Mapping[Key, Any], input_keys: Sequence[Key],
                  candidates: Collection[str]) -> set[str]:
    """The ``candidates`` that hold one of ``input_keys`` in memory or compute one; none
    where an input has no worker yet (then every candidate takes part, as a hand-off on a
    worker outside the run would have to send its input on)."""
    holders: set[str] = set()
    for key in input_keys:
        ts = tasks.get(key)
        if ts is None:
            return set()
        if ts.state == "memory" and ts.who_has:
            holders.update(ws.address for ws in ts.who_has)
        elif ts.processing_on is not None:
            holders.add(ts.processing_on.address)
        else:  # (in memory with no holder: lost with a worker, being released)
            return set()
    return holders & set(candidates)


def near_inputs(tasks: Mapping[Key, Any], affinity: Mapping[Key, Key],
                participants: Sequence[str]) -> dict[Key, str]:
    """Output -> the worker holding the input it needs most (``affinity``: output ->
    that input), where that input is in memory already; no worker gets more than its
    share of the outputs (rounded up), plus one: a service task of a few outputs, one of
    many small ones, then keeps each next to its input, as their inputs are spread
    already."""
    share = -(-len(affinity) // len(participants)) + 1
    load = dict.fromkeys(participants, 0)
    placement = {}
    for out, key in affinity.items():
        ts = tasks.get(key)
        if ts is None or ts.state != "memory" or not ts.who_has:
            continue  # (in memory with no holder: lost with a worker, being released)
        holders = [ws.address for ws in ts.who_has if load.get(ws.address, share) < share]
        if holders:
            worker = min(holders)
            placement[out] = worker
            load[worker] += 1
    return placement


def with_resources(tasks: Mapping[Key, Any], output_keys: Sequence[Key],
                   participants: Sequence[str], workers: Mapping[str, Any],
                   places: dict[Key, str] | None) -> tuple[dict[Key, str] | None, list[Key]]:
    """``places`` with each output whose claim needs worker resources (a consumer run in
    it, annotated with ``resources=``) on a participant that has them, spread over those
    in turn; and the outputs no participant has them for."""
    eligible_by_need: dict[tuple, list[str]] = {}
    turn: dict[tuple, int] = {}
    lacking = []
    for key in output_keys:
        ts = tasks.get(key)
        need = getattr(ts, "resource_restrictions", None) if ts is not None else None
        if not need:
            continue
        signature = tuple(sorted(need.items()))
        eligible = eligible_by_need.get(signature)
        if eligible is None:
            eligible = eligible_by_need[signature] = [
                w for w in participants if w in workers and all(
                    workers[w].resources.get(r, 0) >= q for r, q in need.items())]
        if not eligible:
            lacking.append(key)
            continue
        if places is not None and places.get(key) in eligible:
            continue
        i = turn.get(signature, 0)
        turn[signature] = i + 1
        places = dict(places or {})
        places[key] = eligible[i % len(eligible)]
    return places, lacking


@dataclass
class PlacementGroup:
    """The agreement of the service tasks sharing a ``placement=`` name: output index ->
    worker, and where its round-robin starts; kept while ``service_tasks`` are known."""

    start: int
    by_index: dict[int, str] = field(default_factory=dict)
    service_tasks: int = 0

    def place(self, output_keys: Sequence[Key], participants: Sequence[str],
              workers: Collection[str]) -> dict[Key, str]:
        """Output key -> worker for a run among ``participants``; ``workers`` are those in
        the cluster.

        An index is mapped to a worker once, and again only when that worker has left the
        cluster: a run whose participants leave out a worker of the group (fewer inputs,
        ``participants="input-holders"``) places such an output among its own for itself
        alone, and later runs of the group agree with the earlier ones again.  The
        mapping lasts while a service task of the group is known to the scheduler (the
        two sides of a merge are, together): the next group of the name maps the indices
        over the workers of its own time, so a cluster that grew, a worker paused or a
        run restricted to some workers shapes no later shuffle's placement."""
        result = {}
        for i, key in enumerate(output_keys):
            worker = self.by_index.get(i)
            if worker is None or worker not in workers:
                worker = self.by_index[i] = participants[(self.start + i)
                                                         % len(participants)]
            elif worker not in participants:
                worker = participants[(self.start + i) % len(participants)]
            result[key] = worker
        return result


def owned_as_the_service_says(definition: Any, participants: Sequence[str]
                              ) -> dict[Key, str] | None:
    """Output -> worker as the service class lays its outputs out over ``participants``
    (``Service.output_owners``), or ``None`` where it does not (round robin), or where the
    service task has a placement group or an affinity, which place its outputs instead.
    An answer that is not one worker number per output, or an exception, is logged and
    ignored: the outputs are then dealt round robin, and the run goes on."""
    hook = getattr(definition.service_class, "output_owners", None)
    if hook is None or definition.placement is not None or definition.affinity:
        return None
    outputs = definition.output_keys
    try:
        owners = hook(dict(definition.params), len(outputs), len(participants))
        if owners is None:
            return None
        owners = [operator.index(o) for o in owners]  # (numpy's integers too)
        if len(owners) != len(outputs) or not all(
                0 <= o < len(participants) for o in owners):
            raise ValueError(
                f"it returned {len(owners)} values for {len(outputs)} outputs; each must "
                f"be an int from 0 to {len(participants) - 1}")
    except Exception as e:
        logger.warning("dask_services: %s.output_owners failed (%s: %s); its outputs are "
                       "dealt round robin", definition.service_class.__name__,
                       type(e).__name__, e)
        return None
    return {key: participants[o] for key, o in zip(outputs, owners, strict=True)}
