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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dask._task_spec import Task, TaskRef
from dask.typing import Key

from dask_services._auto_install import note_service_graph
from dask_services.service import OutputsNotProducedError, Service, ServiceGraphError

# ``ServiceDefinition.participants``
PARTICIPANTS = frozenset({"all", "input-holders", "involved"})


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
    # output key -> the input key it needs most: an output is placed on the worker that
    # holds that input when the run starts, as far as the outputs stay balanced
    affinity: dict[Key, Key] | None = None
    # the workers a run takes part on: "all" running workers (the default), or
    # "input-holders": the workers that hold the inputs or compute them when the run starts
    # (all workers where one of them has no place yet), for a service task that moves a
    # small part of a large collection (one region of a rechunk): a run's cost grows with
    # its participants (an instance, a start, a barrier each); or "involved": those and the
    # workers its outputs are placed on, the outputs placed as for "all" (but on the
    # input holders first), for a shuffle or a rechunk: a worker holding no input and
    # owning no output has no instance
    participants: str = "all"
    # the outputs a graph made from this definition can want, where that is not all of
    # them (a graph culled to some outputs, whose service task then takes only the inputs
    # those need): a run in-process, which does not see the graph, produces just these
    wanted_outputs: tuple[Key, ...] | None = None

    def __post_init__(self) -> None:
        note_service_graph()  # the client sending it installs dask_services (_auto_install)
        if self.participants not in PARTICIPANTS:
            raise ValueError(
                f"participants={self.participants!r} is not one of {sorted(PARTICIPANTS)}"
            )

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


def service_key_of_handoffs(prefix: str, handoffs_name: str) -> str:
    """The key of the service task fed by the hand-offs ``(handoffs_name, i)``."""
    from dask.tokenize import tokenize

    return f"{prefix}-{tokenize(handoffs_name)}"


@dataclass(frozen=True)
class ServiceKeyOfHandOff:
    """A hand-off's service key, derived from the hand-off's own task name when it runs
    (:func:`service_key_of_handoffs`): a hand-off that dask fused with the steps making
    its input learns its task name only then."""

    prefix: str

    def resolve(self, handoff_key: Key) -> Key:
        return service_key_of_handoffs(self.prefix, handoff_key[0])


def _executing_key() -> Key | None:
    """The key of the task that this worker thread executes, if any."""
    from distributed.worker import thread_state

    return getattr(thread_state, "key", None)


def _worker_executing(key: Key) -> Any | None:
    """The worker executing task ``key`` on its event loop in this context, if any.

    ``None`` under dask's local schedulers, even when they run inside a worker's task: the
    worker must be executing this very key.
    """
    from distributed.worker import _worker_cvar

    worker = _worker_cvar.get(None)
    if worker is None:
        return None
    ts = worker.state.tasks.get(key)
    if ts is None or ts.state not in ("executing", "long-running", "resumed"):
        return None
    return worker


def _hand_off(handoff_key: Key, service_key: Key, input_key: Key, value: Any) -> Any:
    return value  # local scheduler: pass the input through to the service task


async def _hand_off_on_worker(handoff_key: Key, service_key: Key, input_key: Key,
                              value: Any) -> HandOffReceipt:
    from dask_services.worker import hand_off_on_worker

    run_id = await hand_off_on_worker(handoff_key, service_key, input_key, value)
    return HandOffReceipt(input_key, run_id)


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
            raise OutputsNotProducedError(
                f"the service did not produce output {key!r}: every hook of its run "
                "returned, and nothing of the run was left to produce it; a service must "
                "produce every key of `concierge.wanted_outputs` with "
                "`await concierge.produce_key(key, value)`") from None
    from dask_services.worker import claim_output_on_worker

    return claim_output_on_worker(key)


class HandOffSpec(Task):
    """Run spec of a hand-off task: ``(handoff_key, service_key, input_key, TaskRef(input))``.

    On a worker it is a coroutine, which distributed runs on the worker's event loop: the
    hand-off is mostly the instance's ``add_key`` there, and its CPU work goes to a worker
    service thread through ``concierge.run_in_executor``, so a task thread would only wait.

    It may also be the last step of a fused task (``ShuffleHandOffs``: dask fuses it with
    the blockwise steps that make its input, so no task per partition holds the input
    alone).  The fused task runs in a worker thread under its own key, which the
    scheduler knows as the hand-off; the hand-off is then done through the event loop
    (:func:`_hand_off_in_thread`) under that key, the task thread waiting for it (the
    instance's CPU work runs in service threads, never behind it).
    """

    @property
    def block_fusion(self) -> bool:
        return True

    @property
    def is_coro(self) -> bool:
        return True

    def __call__(self, values: Any = ()) -> Any:
        handoff_key, service_key, input_key, ref = self.args
        value = values[ref.key]
        fused_key = _fused_task_ending_in(handoff_key)
        if fused_key is not None:
            if isinstance(service_key, ServiceKeyOfHandOff):
                service_key = service_key.resolve(fused_key)
            return _hand_off_in_thread(fused_key, service_key, input_key, value)
        if isinstance(service_key, ServiceKeyOfHandOff):
            service_key = service_key.resolve(handoff_key)
        if _worker_executing(handoff_key) is None:
            return self.func(handoff_key, service_key, input_key, value)
        return _hand_off_on_worker(handoff_key, service_key, input_key, value)


def _fused_task_ending_in(key: Key) -> Key | None:
    """The key of the fused task this worker thread executes, if its last step is ``key``
    (not under dask's local schedulers, even inside a worker's task)."""
    executing = _executing_key()
    if executing is None or executing == key:
        return None
    worker = _worker_executing(executing)
    ts = worker.state.tasks.get(executing) if worker is not None else None
    spec = ts.run_spec if ts is not None else None
    if not (isinstance(spec, Task) and spec.has_subgraph() and spec.args[1] == key):
        return None
    return executing


def _hand_off_in_thread(handoff_key: Key, service_key: Key, input_key: Key,
                        value: Any) -> HandOffReceipt:
    """A hand-off from a worker thread (the end of a fused task): the instance takes the
    input on the event loop, as for a hand-off task of its own.  The input is measured
    here, in the thread: the worker holds no measure of it (it was never a task result),
    and measuring a frame on the event loop would hold up the worker's messages."""
    from distributed.utils import sync

    from dask_services._counters import size_of
    from dask_services.worker import _worker_extension, hand_off_on_worker

    worker, _ = _worker_extension()
    run_id = sync(worker.loop, hand_off_on_worker, handoff_key, service_key, input_key,
                  value, size_of(value))
    return HandOffReceipt(input_key, run_id)


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
    local instance produced.  There it is a coroutine, run on the worker's event loop: it
    only takes a value out of a dict, which is not worth a hop to a task thread.
    """

    @property
    def service_key(self) -> Key:
        return self.args[0].key

    @property
    def block_fusion(self) -> bool:
        return True

    @property
    def is_coro(self) -> bool:
        return True

    def __call__(self, values: Any = ()) -> Any:
        service_key = self.service_key
        produced = values[service_key] if service_key in values else None
        if not self.is_coro or _worker_executing(self.args[1]) is None:
            return self.func(produced, *self.args[1:])
        return _claim_output_async(produced, *self.args[1:])


async def _claim_output_async(produced: dict | None, key: Key) -> Any:
    return _claim_output(produced, key)


class Consumer:
    """The only consumer of an output, run by the output's claim (``_claim_fusion``).

    A plain class, not a graph node: dask must not see the consumer's reference to the
    output as a dependency of the claim, which is that output itself.
    """

    __slots__ = ("task",)

    def __init__(self, task: Task) -> None:
        self.task = task

    def __call__(self, value: Any) -> Any:
        (dependency,) = self.task.dependencies
        return self.task({dependency: value})

    def __reduce__(self) -> tuple:
        return (Consumer, (self.task,))

    def __repr__(self) -> str:
        return f"Consumer({self.task.key!r})"


def _claim_and_consume(produced: dict | None, key: Key, consumer: Consumer) -> Any:
    if produced is not None:  # local scheduler: the service task returned every output
        return consumer(_claim_output(produced, key))
    from dask_services.worker import claim_output_on_worker, let_go_of_output_on_worker

    # held until the consumer returned: if it raises, a retry of the task finds it again
    result = consumer(claim_output_on_worker(key, keep=True))
    let_go_of_output_on_worker(key)
    return result


class ConsumingClaimSpec(OutputClaimSpec):
    """An output claim that also runs the output's only consumer: ``args`` are the service
    task's ref, the claim's key and a :class:`Consumer`.  The task has the consumer's key
    (the service task's output key, ``_claim_fusion``) and returns what the consumer
    returns, so the consumer's dependents are unchanged.  It runs in a task thread, as the
    consumer did: a consumer may be any function, which must not hold up the worker's
    event loop."""

    @property
    def is_coro(self) -> bool:
        return False

    @property
    def consumer(self) -> Consumer:
        return self.args[2]


def build_service_graph(
    definition: ServiceDefinition, service_key: Key, input_keys: Sequence[Key],
    handoffs_given: bool = False,
) -> dict[Key, Task]:
    """The tasks of one service task (hand-offs, the task itself, output claims); without
    the hand-offs where ``handoffs_given`` (the graph has them, made by the caller)."""
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
    if len(definition.handoff_keys) != len(input_keys):
        raise ServiceGraphError(
            f"service task {service_key!r} has {len(input_keys)} inputs and "
            f"{len(definition.handoff_keys)} hand-offs; it needs one hand-off per input"
        )
    if not handoffs_given:
        for handoff_key, input_key in zip(definition.handoff_keys, input_keys, strict=True):
            dsk[handoff_key] = HandOffSpec(handoff_key, _hand_off, handoff_key, service_key,
                                           input_key, TaskRef(input_key))
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



def _no_service(*args: Any) -> None:  # stands in for an output claim while ordering
    return None


def order(dsk: Any, dependencies: Any = None, **kwargs: Any) -> Any:
    """``dask.order.order``, with every output claim of a service task in ``dsk`` ordered
    as if it did not depend on its service task.

    Through a service task every input reaches every output, and ``dask.order`` walks,
    for each input it orders, every output that input reaches: work per (input, output)
    pair, 39 s for 4,000 partitions and minutes for 10,000 before the first task runs.
    Ordered without those edges, the inputs reach the service task only and each output
    is a root of its own consumers (4,000 partitions: 1 s).  The edges are only hidden
    from the ordering: the scheduler still sees them, and no output can run before its
    service task has produced it, so what the hidden edges ordered (outputs after the
    hand-offs) holds anyway.  Graphs without a service task are ordered unchanged.
    """
    original = getattr(order, "original", None)
    assert original is not None, "install_order() first"
    if dependencies is not None or not any(isinstance(v, ServiceTaskSpec)
                                           for v in dsk.values()):
        return original(dsk, dependencies, **kwargs)
    hidden = {
        k: (Task(k, _no_service, *v.args[1:]) if isinstance(v, OutputClaimSpec) else v)
        for k, v in dsk.items()
    }
    return original(hidden, **kwargs)


def install_order() -> None:
    """Make ``dask.order.order`` (which the scheduler calls for every new graph) order
    service tasks' graphs with :func:`order` (idempotent)."""
    import dask.order

    if dask.order.order is not order:
        order.original = dask.order.order  # type: ignore[attr-defined]
        dask.order.order = order
