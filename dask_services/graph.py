"""Service tasks in a task graph: hand-offs, the service task, virtual outputs.

A service task ``S`` with inputs ``I_0..I_m`` and outputs ``O_0..O_n`` becomes::

    I_j  ->  H_j (hand-off)  ->  S (service task)  ->  O_k (output claim)

* ``H_j`` depends on ``I_j`` only, so it runs where ``I_j`` lives; on a cluster it pushes
  ``I_j`` into the local instance (``add_key``) and returns a tiny receipt.
* ``S`` waits, without holding a thread slot, until the run is over.
* ``O_k`` declares ``S`` as its only dependency but is never computed from it: when an
  instance calls ``produce_key(O_k, v)`` the scheduler plugin cuts the edge ``S -> O_k`` and
  runs the claim on the producing worker, where it returns ``v``.

Under dask's local schedulers the same graph runs in-process: hand-offs pass their input
through, ``S`` runs every instance in-process (``local.py``) and returns ``{O_k: v}``, and
each claim picks its value from that dict.  All three node types block fusion.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dask._task_spec import Task, TaskRef

from dask_services.service import OutputLostError, Service, ServiceGraphError

Key = Hashable


@dataclass(frozen=True)
class ServiceDefinition:
    """Everything the framework needs to know about one service task."""

    service_class: type[Service]
    params: dict[str, Any]
    input_keys: tuple[Key, ...]
    handoff_keys: tuple[Key, ...]
    output_keys: tuple[Key, ...]
    placement: str | None = None
    name: str = field(default="")

    def __dask_tokenize__(self) -> tuple:
        from dask.tokenize import tokenize

        return (
            "ServiceDefinition",
            tokenize(self.service_class, self.params),
            self.input_keys,
            self.output_keys,
            self.placement,
        )


@dataclass(frozen=True)
class HandOffReceipt:
    """What a hand-off returns on a cluster: the input now lives in an instance."""

    input_key: Key
    run_id: int | None


def _executing_key() -> Key | None:
    """The key of the task that this worker thread executes, if any."""
    from distributed.worker import thread_state

    return getattr(thread_state, "key", None)


def _hand_off(handoff_key: Key, service_key: Key, input_key: Key, value: Any) -> Any:
    if _executing_key() == handoff_key:
        from dask_services.worker import hand_off_on_worker

        run_id = hand_off_on_worker(handoff_key, service_key, input_key, value)
        return HandOffReceipt(input_key, run_id)
    return value  # local scheduler: pass the input through to the service task


def _run_service_task(definition: ServiceDefinition, service_key: Key, *inputs: Any) -> Any:
    if _executing_key() == service_key:
        from dask_services.worker import wait_for_service_task

        wait_for_service_task(service_key)
        return None
    from dask_services.local import run_in_process

    return run_in_process(
        definition, service_key, dict(zip(definition.input_keys, inputs, strict=True))
    )


def _claim_output(produced: dict | None, key: Key) -> Any:
    if produced is not None:  # local scheduler: the service task returned every output
        try:
            return produced[key]
        except KeyError:
            raise OutputLostError(f"the service did not produce output {key!r}") from None
    from dask_services.worker import claim_output_on_worker

    return claim_output_on_worker(key)


class HandOffSpec(Task):
    """Run spec of a hand-off task."""

    @property
    def block_fusion(self) -> bool:
        return True


class ServiceTaskSpec(Task):
    """Run spec of a service task; ``args[0]`` is its :class:`ServiceDefinition`."""

    @property
    def definition(self) -> ServiceDefinition:
        return self.args[0]

    @property
    def block_fusion(self) -> bool:
        return True


class OutputClaimSpec(Task):
    """Run spec of a virtual output: depends on the service task, never reads its value.

    On a cluster the scheduler plugin removes the dependency before the claim runs, so the
    value of the service task is absent from ``values``; the claim then returns what the
    local instance produced.
    """

    @property
    def service_key(self) -> Key:
        return self.args[0].key

    @property
    def block_fusion(self) -> bool:
        return True

    def __call__(self, values: Any = ()) -> Any:
        service_key = self.service_key
        produced = values[service_key] if service_key in values else None
        return self.func(produced, *self.args[1:])


def build_service_graph(
    definition: ServiceDefinition, service_key: Key, input_keys: Sequence[Key]
) -> dict[Key, Task]:
    """The tasks of one service task (hand-offs, the task itself, output claims)."""
    if len(set(definition.output_keys)) != len(definition.output_keys):
        raise ServiceGraphError(
            f"service task {service_key!r} names an output key twice; output keys must "
            "be unique"
        )
    shared = set(definition.output_keys) & set(input_keys)
    if shared:
        raise ServiceGraphError(
            f"key {next(iter(shared))!r} is both an input and an output of service task "
            f"{service_key!r}; give the outputs other names"
        )
    dsk: dict[Key, Task] = {}
    for handoff_key, input_key in zip(definition.handoff_keys, input_keys, strict=True):
        dsk[handoff_key] = HandOffSpec(
            handoff_key, _hand_off, handoff_key, service_key, input_key, TaskRef(input_key)
        )
    dsk[service_key] = ServiceTaskSpec(
        service_key,
        _run_service_task,
        definition,
        service_key,
        *(TaskRef(k) for k in definition.handoff_keys),
    )
    for out in definition.output_keys:
        dsk[out] = OutputClaimSpec(out, _claim_output, TaskRef(service_key), out)
    return dsk

