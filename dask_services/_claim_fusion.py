"""An output's only consumer runs in the output's claim.

A service task's output is a claim (``graph.OutputClaimSpec``): once an instance produced
the value, the scheduler runs the claim on that worker, which moves the value into the
worker's memory, and then the consumer (the ``.sum()`` of an output chunk) is a task of
its own.  Every output so costs two tasks, each a scheduler round trip, and holds its
whole value in memory between the two.  dask's own linear fusion joins such a chain into
one task, but claims block fusion (the scheduler plugin knows them by type).

:func:`fuse_consumers` does that join for the service tasks whose service knows its
outputs by position (``Service.outputs_by_position``, the rechunk's): where an output has
exactly one dependent, that dependent depends on nothing else and is a plain task, the
claim becomes a :class:`~dask_services.graph.ConsumingClaimSpec` under the consumer's
key, which runs the consumer on the produced value; the consumer's dependents are
unchanged.  The consumer then runs as soon as its output is produced, in the same task,
and the output's value is freed as soon as the consumer returns.

A key names one value, so the fused service task is a new one: its outputs are the
consumers' keys, and its own key, its hand-offs' and its other outputs' take a suffix
that depends on them.  Two graphs that consume the same rechunk differently, live at
once, are then two service tasks, as two rechunks would be, not one task with two
meanings.  The consumers' keys are shared by such graphs, and distributed keeps the
meaning it knew while a key is held: the scheduler plugin counts an output as a service
task's only where the scheduler's task for that key is that service task's claim.
A service task with an output that was asked for is left as it is.

Applied by ``array._fusion`` after dask.array's linear fusion (so not when
``optimization.fuse.active`` is False), and never when ``dask_services.fuse-consumers`` is
False.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from dask._task_spec import Task, TaskRef
from dask.core import flatten
from dask.tokenize import tokenize
from dask.typing import Key

from dask_services.config import setting
from dask_services.graph import (
    Consumer,
    ConsumingClaimSpec,
    HandOffSpec,
    OutputClaimSpec,
    ServiceTaskSpec,
    _claim_and_consume,
    _claim_output,
    _hand_off,
    _run_service_task,
)


def fuse_consumers(dsk: dict, keys: Iterable) -> dict:
    """``dsk`` with the lone consumers of service outputs fused into their claims (see the
    module docstring); ``keys``: the keys asked for."""
    if not setting("fuse-consumers"):
        return dsk
    services = [node for node in dsk.values()
                if isinstance(node, ServiceTaskSpec)
                and getattr(node.definition.service_class, "outputs_by_position", False)]
    if not services:
        return dsk
    asked = set(flatten(keys)) if isinstance(keys, list) else {keys}
    dependents: dict[Key, list[Key]] = {}
    for key, node in dsk.items():
        for dep in node.dependencies:
            dependents.setdefault(dep, []).append(key)
    result = dict(dsk)
    for service in services:
        consumers = _lone_consumers(dsk, service, asked, dependents)
        if consumers:
            _fuse(result, service, consumers, dependents)
    return result


def _lone_consumers(dsk: dict, service: ServiceTaskSpec, asked: set,
                    dependents: dict[Key, list[Key]]) -> dict[Key, Key]:
    """Output key -> its consumer's key, for the outputs of ``service`` that can take their
    consumer in; empty where the service task must stay as it is."""
    definition = service.definition
    if any(out in asked for out in definition.output_keys) or not all(
            type(dsk.get(h)) is HandOffSpec for h in definition.handoff_keys):
        return {}
    consumers = {}
    for out in definition.output_keys:
        users = dependents.get(out, ())
        if type(dsk.get(out)) is not OutputClaimSpec or len(users) != 1:
            continue
        node = dsk[users[0]]
        if type(node) is Task and not node.block_fusion and node.dependencies == {out}:
            consumers[out] = users[0]
    # an output that stays a claim is renamed, and the tasks using it are rewritten: only
    # plain tasks, never another service task's nodes (a hand-off names its input key in
    # its service's definition too)
    for out in definition.output_keys:
        if out not in consumers and any(
                isinstance(dsk[user], (HandOffSpec, ServiceTaskSpec, OutputClaimSpec))
                for user in dependents.get(out, ())):
            return {}
    return consumers


def renamed_key(key: Key, suffix: str) -> Key:
    """``key`` with ``suffix`` on its name (a tuple key's first element)."""
    if isinstance(key, tuple):
        return (f"{key[0]}-{suffix}", *key[1:])
    return f"{key}-{suffix}"


def _fuse(result: dict, service: ServiceTaskSpec, consumers: dict[Key, Key],
          dependents: dict[Key, list[Key]]) -> None:
    """Replace, in ``result``, the tasks of ``service`` by a service task whose outputs
    ``consumers`` are fused with their consumers."""
    definition = service.definition
    suffix = tokenize(service.key, sorted(consumers.items(), key=str))
    new_key = renamed_key(service.key, suffix)
    handoffs = {h: renamed_key(h, suffix) for h in definition.handoff_keys}
    outputs = {out: consumers.get(out) or renamed_key(out, suffix)
               for out in definition.output_keys}
    new_definition = dataclasses.replace(
        definition,
        handoff_keys=tuple(handoffs.values()),
        output_keys=tuple(outputs.values()),
        wanted_outputs=None if definition.wanted_outputs is None else tuple(
            outputs[out] for out in definition.wanted_outputs),
        affinity=None if definition.affinity is None else {
            outputs[out]: key for out, key in definition.affinity.items()},
    )
    del result[service.key]
    result[new_key] = ServiceTaskSpec(new_key, _run_service_task, new_definition, new_key,
                                      *(TaskRef(h) for h in handoffs.values()))
    for old, new in handoffs.items():
        handoff = result.pop(old)
        _, _, input_key, ref = handoff.args
        result[new] = HandOffSpec(new, _hand_off, new, new_key, input_key, ref)
    ref = TaskRef(new_key)
    for out, new in outputs.items():
        if out not in result:
            continue  # culled: not needed by this graph
        del result[out]
        if out in consumers:
            result[new] = ConsumingClaimSpec(new, _claim_and_consume, ref, new,
                                             Consumer(result[new]))
            continue
        result[new] = OutputClaimSpec(new, _claim_output, ref, new)
        for user in dependents.get(out, ()):
            result[user] = result[user].substitute({out: new})
