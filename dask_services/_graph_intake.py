"""The scheduler plugin's intake of a graph: what ``update_graph`` learns of the service
tasks, claims and hand-offs a graph brings (``ServiceSchedulerPlugin`` inherits it).

It registers each new service task (its machine, its outputs, hand-offs and placement
group), orders its hand-offs, checks the graph's rules (a service task is never asked for
directly, an output depends on its service task alone), forgets claims nothing needs,
tells a machine which of its outputs are wanted, and makes hand-offs run where their input
lives.  Should any of it raise, each service task the graph brought fails, naming the
exception, rather than wait for a run nothing prepares.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from dask.typing import Key

from dask_services import _run_events as run_events
from dask_services import _run_model as run_model
from dask_services import _run_placement as placement
from dask_services import _run_state as rs
from dask_services.graph import (
    ConsumingClaimSpec,
    OutputClaimSpec,
    ServiceDefinition,
    ServiceTaskSpec,
)
from dask_services.service import ServiceGraphError

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler, TaskState

logger = logging.getLogger("dask_services")


class GraphIntake:
    """``update_graph`` and what it needs, on the plugin's own state: ``machines``,
    ``definitions``, ``output_of``, ``handoff_of``, ``input_of_handoff``,
    ``handoffs_of_input``, ``placements``, ``archive``, ``maybe_unneeded``, ``cut``,
    ``pinned`` and ``scheduler`` (see ``ServiceSchedulerPlugin.__init__``)."""

    # (set by ServiceSchedulerPlugin)
    scheduler: Scheduler
    machines: dict
    definitions: dict
    output_of: dict
    handoff_of: dict
    input_of_handoff: dict
    handoffs_of_input: dict
    placements: dict
    archive: dict
    maybe_unneeded: set
    cut: Any
    pinned: dict
    _next_owner: int
    max_restarts: int
    # and its methods _later, _forget_if_unneeded, _wanted and _event

    def update_graph(self, scheduler: Scheduler, *, keys: Any, tasks: Any = (),
                     **kwargs: Any) -> None:
        known = set(self.machines)
        try:
            self._take_in(scheduler, keys, tasks)
        except Exception as exc:
            # distributed logs a plugin's exception here and goes on with the graph: a
            # service task it made would wait for a run nothing prepares
            logger.exception("dask_services: taking in a graph failed")
            self._reject_new_service_tasks(tasks, known, exc)

    def _reject_new_service_tasks(self, keys: Any, known: set[Key],
                                  exc: Exception) -> None:
        """Each service task this graph brought fails with ``exc`` named, once it runs."""
        tasks = self.scheduler.tasks
        for key in keys:
            ts = tasks.get(key)
            if ts is None or key in known or not isinstance(ts.run_spec, ServiceTaskSpec):
                continue
            try:
                if key not in self.machines:
                    definition = ts.run_spec.definition
                    self.machines[key] = rs.ServiceTaskMachine(
                        key, definition.input_keys, definition.output_keys,
                        self.max_restarts)
                self._event(key, run_events.GraphRejected(
                    ServiceGraphError(
                        f"the scheduler could not take in service task {key!r}: "
                        f"{type(exc).__name__}: {exc} (its traceback is in the "
                        "scheduler's log); nothing of it ran"),
                    stimulus_id=run_model.new_stimulus_id("update-graph")))
            except Exception:
                logger.exception("dask_services: could not reject service task %r", key)

    def _take_in(self, scheduler: Scheduler, keys: Any, tasks: Any) -> None:
        tasks_ = scheduler.tasks
        new_services = []
        for key in tasks:
            ts = tasks_.get(key)
            if ts is None:
                continue
            spec = ts.run_spec
            if isinstance(spec, ServiceTaskSpec) and key not in self.machines:
                new_services.append(ts)
        for ts in new_services:
            self._register(ts)
            self._order_inputs(ts.run_spec.definition)
            if not ts.dependents and not ts.who_wants and ts.key not in self.maybe_unneeded:
                # each of its outputs is known with another meaning the scheduler keeps
                # (``_register``): it was made for them, and nothing will ever need it
                self.maybe_unneeded.add(ts.key)
                self._later(self._forget_if_unneeded, ts.key,
                            run_model.new_stimulus_id("service-task-unneeded"))
        orphans = []
        for key in tasks:
            ts = tasks_.get(key)
            if ts is None:
                continue
            # an output's owner follows the key's meaning now (made again, as a claim or
            # a plain task, after it was forgotten while its service task stayed)
            if isinstance(ts.run_spec, OutputClaimSpec):
                machine = self.machines.get(ts.run_spec.service_key)
                # (a claim its service task does not list, as dask's graph_manipulation
                # makes by renaming keys, is refused below and never counted)
                if machine is not None and key in machine.output_key_set:
                    self.output_of[key] = ts.run_spec.service_key
                if self._is_orphan_claim(ts):
                    orphans.append(key)
            elif key in self.output_of:
                del self.output_of[key]
            if isinstance(ts.run_spec, (ServiceTaskSpec, OutputClaimSpec)):
                self._check_graph_rules(ts, keys)
        if orphans:
            self._later(self._forget_orphan_claims, orphans,
                        run_model.new_stimulus_id("orphan-claims"))
        for service_key in {self.output_of[k] for k in tasks if k in self.output_of}:
            if service_key in self.machines and service_key in tasks_:
                self._event(service_key, run_events.OutputsWanted(
                    self._wanted(service_key),
                    stimulus_id=run_model.new_stimulus_id("update-graph")))
        for key in tasks:
            if key in self.handoff_of:
                self._restrict_handoff(tasks_[key])
            elif key in self.machines or key in self.output_of:
                self._free_of_resources(tasks_.get(key))

    def _is_orphan_claim(self, ts: TaskState | None) -> bool:
        """A claim that nothing needs and nothing will: distributed makes the tasks a new
        spec depends on even where it keeps a held key's old spec (a consumer fused into
        a claim in one graph, a plain task in the next), and only the new spec needed
        them.  They stay ``released`` for the scheduler's life, and their service task
        with them, unless forgotten."""
        return (ts is not None and isinstance(ts.run_spec, OutputClaimSpec)
                and ts.state == "released" and not ts.dependents and not ts.who_wants
                and not ts.waiters and ts.key not in self.cut)

    def _forget_orphan_claims(self, keys: list[Key], stimulus_id: str) -> None:
        tasks = self.scheduler.tasks
        orphans = [k for k in keys if self._is_orphan_claim(tasks.get(k))]
        if orphans:
            self.scheduler.transitions(dict.fromkeys(orphans, "forgotten"),
                                       stimulus_id=stimulus_id)

    @staticmethod
    def _free_of_resources(ts: TaskState | None) -> None:
        """A service task and its outputs' claims need no worker resources
        (``dask.annotate(resources=...)`` annotates them with the rest of the graph): the
        service task only waits for its run (seceded, it would hold the unit all along,
        and the claims needing it on its worker would never run), and a claim runs on the
        worker that produced its output, whatever that worker has.  A claim running its
        output's consumer (``ConsumingClaimSpec``) keeps the consumer's: its output is
        produced on a worker that has them (``_run_placement.with_resources``)."""
        if ts is not None and ts.state == "released" and ts.resource_restrictions \
                and not isinstance(ts.run_spec, ConsumingClaimSpec):
            ts.resource_restrictions = None

    def _register(self, ts: TaskState) -> None:
        definition: ServiceDefinition = ts.run_spec.definition
        key = ts.key
        self.definitions[key] = definition
        if definition.placement is not None:
            group = self.placements.get(definition.placement)
            if group is None:
                # its round-robin starts where the last one stopped, as runs without a
                # group do: many small groups (shuffles into one partition) spread out
                group = self.placements[definition.placement] = placement.PlacementGroup(
                    start=self._next_owner)
                self._next_owner += len(definition.output_keys)
            group.service_tasks += 1
        machine = self.machines[key] = rs.ServiceTaskMachine(
            key, definition.input_keys, definition.output_keys, self.max_restarts,
            validating=bool(getattr(self.scheduler, "validate", False)),
        )
        archived = self.archive.pop(key, None)
        if archived:  # submitted again: its earlier runs' stories go on in the new machine
            machine.stories.update(archived)
        for h, i in zip(definition.handoff_keys, definition.input_keys, strict=True):
            self.handoff_of[h] = key
            self.input_of_handoff[h] = i
            self.handoffs_of_input.setdefault(i, set()).add(h)
        tasks = self.scheduler.tasks
        for o in definition.output_keys:
            ots = tasks.get(o)
            if ots is not None and not (isinstance(ots.run_spec, OutputClaimSpec)
                                        and ots.run_spec.service_key == key):
                # the key is known with another meaning, which the scheduler keeps (a
                # consumer fused into another service task's claim, then submitted
                # again unfused, or the other way round): not an output of this one
                continue
            self.output_of[o] = key

    def _order_inputs(self, definition: ServiceDefinition) -> None:
        """Hand-offs (and inputs computed by the same graph) run in the order of the
        service's inputs.  dask.order sees every input reach every output through the
        service task, so the order it gives them carries no meaning: for a rechunk it
        scatters the hand-offs, and outputs whose inputs are near each other wait until
        late.  The tasks keep the priorities they had, shared out anew."""
        tasks = self.scheduler.tasks
        for keys in (definition.handoff_keys, definition.input_keys):
            states = [tasks.get(k) for k in keys]
            if any(ts is None or ts.state != "released" or ts.priority is None
                   for ts in states):
                continue  # not all new: leave them as they are
            for ts, priority in zip(states, sorted(ts.priority for ts in states),
                                    strict=True):
                ts.priority = priority

    def _check_graph_rules(self, ts: TaskState, requested: Any) -> None:
        problem = None
        if isinstance(ts.run_spec, ServiceTaskSpec):
            if ts.key in requested or ts.who_wants:
                problem = (
                    f"service task {ts.key!r} was asked for directly; a service task "
                    "cannot be computed or held by a future, only its outputs can"
                )
            for dts in ts.dependents:
                if dts.key not in self.output_of or self.output_of[dts.key] != ts.key:
                    problem = (
                        f"task {dts.key!r} depends on service task {ts.key!r} but is not "
                        "one of its outputs; depend on the outputs instead (a graph whose "
                        "keys were renamed after it was built, as dask.graph_manipulation's "
                        "clone() and bind() rename them, still names the original service "
                        "task inside its tasks: build the collection again instead)"
                    )
        elif isinstance(ts.run_spec, OutputClaimSpec) and len(ts.dependencies) > 1:
            problem = (
                f"output {ts.key!r} of a service task depends on "
                f"{sorted(map(str, (d.key for d in ts.dependencies)))}; an output key must "
                "depend on exactly one service task and nothing else"
            )
        if problem is None:
            return
        service_key = (
            ts.key if isinstance(ts.run_spec, ServiceTaskSpec) else ts.run_spec.service_key
        )
        logger.error("dask_services: rejected graph: %s", problem)
        self._event(service_key, run_events.GraphRejected(
            ServiceGraphError(problem), stimulus_id=run_model.new_stimulus_id("update-graph")))

    def _restrict_handoff(self, hts: TaskState) -> None:
        """Make a hand-off run where its input already lives."""
        if hts.state not in ("released", "waiting") or hts.key in self.pinned:
            return
        if len(hts.dependencies) != 1:
            return  # none, or a fused hand-off making its input from several
        (dep,) = hts.dependencies
        if dep.who_has:
            self.scheduler.set_restrictions({hts.key: [ws.address for ws in dep.who_has]})
            hts.loose_restrictions = True  # no API for it: see design/architecture.md
