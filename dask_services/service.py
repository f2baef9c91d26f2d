"""The user-facing contract of a service: ``Service``, ``ServiceId``, ``@rpc``, ``Concierge``.

Nothing in this module does I/O.  The hosts (``_host.py``) call these hooks; the scheduler
plugin decides when.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from dask.typing import Key

from dask_services._deployable import Deployable

T = TypeVar("T")

_RPC_MARK = "__dask_services_rpc__"


class ServiceId(str):
    """Opaque identifier of one instance of one run of a service task.

    Unique per (run, worker) and never reused, even when a worker comes back at the same
    address: a message addressed to an old id can never reach a newer run.  Compare and
    hash it, use it as a dict key; do not parse it.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"ServiceId({str.__repr__(self)})"


def rpc(method: Callable[..., T]) -> Callable[..., T]:
    """Mark a method of a :class:`Service` as callable by peers.

    Only marked methods can be reached through ``self.peers[sid].name(...)``; any other name
    (private attributes, hooks, ``__class__``...) is refused with :class:`RPCRefused`.
    """
    setattr(method, _RPC_MARK, True)
    return method


def is_rpc_method(cls: type, name: str) -> bool:
    """Whether ``name`` is an ``@rpc`` method of ``cls`` (looked up on the class only)."""
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        return False
    attr = getattr(cls, name, None)
    return callable(attr) and getattr(attr, _RPC_MARK, False) is True


class PeerHandle(Protocol):
    """A handle on another instance of the same run: ``await handle.method(*args)``."""

    id: ServiceId

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]: ...


class Concierge(abc.ABC):
    """An instance's window onto its worker and the scheduler.

    The framework gives one concierge to every instance in :meth:`Service.start`.
    """

    @property
    @abc.abstractmethod
    def run_id(self) -> int:
        """Number of the current run of the service task (a restart is a new run)."""

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Address of the worker hosting this instance."""

    @property
    @abc.abstractmethod
    def local_directory(self) -> str:
        """A directory private to this instance, removed after :meth:`Service.stop`."""

    @property
    @abc.abstractmethod
    def memory_limit(self) -> int | None:
        """The worker's memory limit in bytes, or None when it has none."""

    @property
    @abc.abstractmethod
    def memory_to_plan_on(self) -> int:
        """Bytes to size this instance's buffers from: the worker's memory limit, or where
        it has none, the share of the host's memory that distributed's
        ``memory_limit="auto"`` would have given it (never unbounded)."""

    @property
    @abc.abstractmethod
    def wanted_outputs(self) -> Sequence[Key]:
        """The output keys this run must produce, in priority order.

        A subset of ``output_keys``: outputs culled from the graph or already in memory are
        not wanted.  The run finishes once every wanted output has been produced.
        """

    @abc.abstractmethod
    def owner(self, output_key: Key) -> ServiceId:
        """The instance that should produce ``output_key`` (the default placement).

        Deterministic for the run; two service tasks submitted with the same ``placement``
        parameter agree on it, so partition *i* of both ends up on the same worker.  An
        output the run does not need has an owner too (producing it is a no-op);
        ``ProduceKeyError`` for a key that is not an output.
        """

    @abc.abstractmethod
    def produce_key(self, key: Key, value: Any, *, nbytes: int | None = None
                    ) -> Coroutine[Any, Any, bool]:
        """Hand ``value`` back to the graph as the result of output ``key``:
        ``await concierge.produce_key(key, value)``.

        The key reaches memory on this instance's worker; its dependents may start while
        the service still runs.  The output is produced when the method is called (and
        errors raised there); the coroutine it returns waits while the worker is paused
        for lack of memory, so a service producing many outputs cannot outrun their
        consumers.  An ``await`` forgotten skips that wait (Python warns that the
        coroutine was never awaited) but loses no output.  Called off the event loop (a
        service thread making the coroutine for ``asyncio.run_coroutine_threadsafe``), it
        produces when the coroutine runs on the loop.  Each wanted output may be produced
        once per run, by any instance.

        Returns True when the value was kept, and False (dropping it, with a debug log
        line) when ``key`` is one of ``output_keys`` that this run does not need: culled,
        already in memory, or released by its futures.  So a service may simply produce
        every output; ``wanted_outputs`` only saves it the work.
        Raises :class:`ProduceKeyError` for a key that is not an output of the task, or a
        wanted output this instance produced already.  The same output produced by two
        instances fails the run with ``ProduceKeyError`` while the run still waits for
        outputs; once it has them all the run is over and the later value is dropped
        (after the second instance got True: the answer is its own worker's, which
        cannot know), so produce each output on one instance (``owner(key)``).

        ``nbytes``: the value's size as dask's ``sizeof`` measures it, where the service
        knows it (it measured the value in a service thread, where it built it).  The
        worker then takes it instead of measuring the value on its event loop, twice (for
        the scheduler and for its memory manager): ~0.2 ms a call for a pandas frame.  A
        value that cannot be weakly referenced (``int``, ``list``, ``dict``, ``tuple``) is
        measured all the same.  Raises ``ValueError`` for a size that is not a
        non-negative integer.
        """

    def input_nbytes(self, key: Key) -> int | None:
        """The size in bytes of input ``key`` as its worker measured it (dask's ``sizeof``),
        while :meth:`Service.add_key` receives it; None where nothing measured it.  Saves
        a service that accounts for its inputs' memory measuring each one again."""
        return None

    @abc.abstractmethod
    def error(self, exc: BaseException) -> None:
        """Fail the whole service task with ``exc``; every instance then gets ``stop``."""

    def fail(self, exc: BaseException) -> None:
        """Alias of :meth:`error`."""
        self.error(exc)

    @abc.abstractmethod
    def restart(self, reason: str = "restart requested by the service") -> None:
        """Restart the service task: a new run, with new ids, after every instance stopped."""

    @abc.abstractmethod
    def run_in_executor(self, fn: Callable[..., T], *args: Any, **kwargs: Any
                        ) -> Coroutine[Any, Any, T]:
        """Run CPU-heavy ``fn`` in one of the worker's service threads (``dask_services.threads``,
        apart from its task threads); await the coroutine returned for its result.

        ``fn`` is submitted in the call, as ``loop.run_in_executor`` does: without the
        ``await`` it runs all the same (Python warns that the coroutine was never awaited).
        """


class Service(Deployable, abc.ABC):
    """A stateful, distributed subsystem whose instances live on Dask workers.

    One instance per participating worker carries out a *run* of a *service task*.  The
    framework calls the hooks below, in this order, on the worker's event loop:

    ``start`` once; ``all_started`` once every instance has started; ``add_key`` once per
    input key, on a worker that holds it; ``all_inputs_done`` once ``add_key`` has returned
    for every input everywhere; and ``stop`` exactly once, on success, error, restart or
    cancellation.  Hand results back with ``await self.concierge.produce_key(key, value)``.

    Instances are created with no arguments.  Before ``start`` is called the framework sets
    ``self.id``, ``self.key``, ``self.peers``, ``self.input_keys``, ``self.output_keys``,
    ``self.concierge``, ``self.leader`` and ``self.params``, so a service that only needs
    those does not have to override ``start`` at all.

    The same class can also be deployed as long-lived replicas called through its
    ``@endpoint`` methods: ``options()``, ``as_service()`` and ``service_options`` come
    from :class:`~dask_services._deployable.Deployable` (``dask_services/replicated/``).
    """

    # True for a service that tells its outputs apart by their position in
    # ``output_keys``, never by the keys' names: the graph may then give an output the key
    # of its lone consumer and run that consumer in the output's claim (``_claim_fusion``).
    outputs_by_position: bool = False

    @classmethod
    def output_owners(cls, params: dict[str, Any], outputs: int, workers: int
                      ) -> Sequence[int] | None:
        """Which of a run's ``workers`` (numbered 0 to ``workers - 1`` in the run's order)
        owns each of the service task's ``outputs`` (one number per position in
        ``output_keys``), where the service wants a layout of its own; ``None`` (the
        default): the framework deals them round robin.  Called on the scheduler when a
        run is prepared, with the ``params`` the service task was given; not called where
        the task has a ``placement=`` group or an ``affinity``, which place its outputs.
        Each instance sees the result through ``concierge.owner``.  The rechunk gives
        each worker a box of neighbouring output chunks (``array/_plan.py``)."""
        return None

    id: ServiceId
    key: Key
    peers: Mapping[ServiceId, PeerHandle]
    input_keys: Sequence[Key]
    output_keys: Sequence[Key]
    concierge: Concierge
    leader: ServiceId
    params: dict[str, Any]

    async def start(
        self,
        id: ServiceId,
        key: Key,
        peers: Mapping[ServiceId, PeerHandle],
        input_keys: Sequence[Key],
        output_keys: Sequence[Key],
        concierge: Concierge,
        leader: ServiceId,
        **kwargs: Any,
    ) -> None:
        """Called once per instance before anything else; must not wait for peers."""

    async def all_started(self) -> None:
        """Called once every instance of the run has returned from ``start``."""

    async def add_key(self, key: Key, data: Any) -> None:
        """Receive one input.  ``data`` is the graph's value, shared with every task that
        uses the key: keep it, change only a copy (a numpy array comes read-only)."""
        raise NotImplementedError(
            f"{type(self).__name__} received input {key!r} but does not define add_key(); "
            "define `async def add_key(self, key, data)` to accept inputs"
        )

    async def all_inputs_done(self) -> None:
        """Called once ``add_key`` has returned for every input of the run, everywhere."""

    async def stop(self) -> None:
        """Called exactly once; release everything the instance holds before returning."""

    def __sizeof__(self) -> int:
        """Bytes of memory the instance holds (counted by the worker as managed memory)."""
        return object.__sizeof__(self)

    def spilled_bytes(self) -> int:
        """Bytes the instance keeps on disk."""
        return 0

    def counters(self) -> Mapping[str, int]:
        """Cumulative figures of this instance, shown by ``dask_services.status()``, the
        dashboard's ``/services`` page and the Prometheus metrics (summed over the run).

        Known names: ``bytes_sent`` and ``bytes_received`` (data exchanged with peers) and
        ``bytes_spilled`` (data written to disk).  The framework counts the first two itself
        for every service, from the peer calls it carries (``_counters.py``); a value
        returned here overrides its count of the same name, and a missing one keeps it
        (``bytes_spilled`` counts as 0).  Called on the worker's event loop at every
        heartbeat and once after ``stop``: keep it cheap.
        """
        return {}

    async def please_evict(self, nbytes: int) -> None:
        """The worker is under memory pressure: free about ``nbytes`` if you can."""


# What ``Service.start`` receives before the service task's keyword parameters, and what
# the framework sets on every instance of a service task before ``start``.
START_ARGUMENTS = ("id", "key", "peers", "input_keys", "output_keys", "concierge", "leader")
INSTANCE_ATTRIBUTES = (*START_ARGUMENTS, "params")


def refuse_own_values(service: object, names: Sequence[str], what: str) -> None:
    """Refuse an instance whose ``__init__`` set one of ``names`` (attributes the framework
    sets on each instance right after making it, ``what`` says which): the framework's
    value would replace the service's own without a word, and the service fail later, far
    from the cause."""
    own = getattr(service, "__dict__", {})
    clashes = [name for name in names if name in own]
    if clashes:
        cls = type(service).__name__
        listed = ", ".join(f"self.{name}" for name in clashes)
        raise TypeError(
            f"{cls}.__init__ sets {listed}, but dask_services sets "
            f"{'these' if len(clashes) > 1 else 'this'} on {what} right after making it "
            f"(it sets {', '.join(names)}), which would replace yours; rename "
            f"{'them' if len(clashes) > 1 else 'it'}, e.g. with a leading underscore "
            f"(self._{clashes[0]})")


def check_instance_attributes(cls: type, names: Sequence[str], what: str) -> None:
    """Refuse a class that defines one of ``names`` (attributes the framework sets on each
    of its instances, ``what`` says when) as a method, a property without a setter or a
    descriptor that cannot be set.

    The framework's assignment would fail on those (on the worker, after the graph was
    sent) or silently replace a method; a plain class attribute (a default the
    framework's value shadows), a property with a setter or a ``__slots__`` member takes
    the value and is fine.
    """
    import inspect

    clashes = []
    for name in names:
        owner = next((c for c in cls.__mro__ if name in vars(c)), None)
        if owner is None or owner.__module__.startswith("dask_services."):
            continue
        value = inspect.getattr_static(owner, name)
        if isinstance(value, property):
            if value.fset is None:  # read-only: the assignment fails
                clashes.append(f"{name!r} (a property without a setter, in "
                               f"{owner.__name__})")
        elif callable(value) or isinstance(value, (staticmethod, classmethod)):
            clashes.append(f"{name!r} (a method, in {owner.__name__})")  # replaced
        elif hasattr(type(value), "__get__") and not hasattr(type(value), "__set__"):
            clashes.append(f"{name!r} (a descriptor it cannot set, in {owner.__name__})")
        # a data descriptor that takes the value (a property with a setter, a __slots__
        # member) or a plain class attribute (a default) is fine
    if clashes:
        raise TypeError(
            f"{cls.__name__} defines {', '.join(clashes)}, but dask_services sets "
            f"{'these' if len(clashes) > 1 else 'this'} on {what} (it sets "
            f"{', '.join(names)}); rename yours, e.g. with a leading underscore or a "
            "prefix of your own")


class ServiceError(Exception):
    """Base class of the errors raised by dask-services itself."""


class RPCRefused(ServiceError):
    """A peer asked for a method that is not marked with ``@dask_services.rpc``."""


class PeerCallError(ServiceError):
    """A peer call's arguments or result could not be serialized or deserialized."""


class PeerUnreachableError(ServiceError):
    """A peer call's connection to the peer's worker failed (the worker died or left).
    Let out of a hook, it restarts the run rather than failing it, as the peer's loss
    does: a new run (new ids, the workers that are there) gets every input again."""


class StaleRunError(ServiceError):
    """A message was addressed to an instance of a run that is no longer current."""


class ProduceKeyError(ServiceError, KeyError):
    """``produce_key`` was called with a key that is not an output, or twice."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ServiceGraphError(ServiceError, ValueError):
    """A graph breaks a rule of service tasks (see the message for the key and the fix)."""


class WorkerSetupError(ServiceError):
    """dask_services could not set up on a worker (a bad config value given to the workers
    alone, say): a run needing that worker, and a hand-off on it, fail with this error."""


class TooManyRestarts(ServiceError):
    """A service task was restarted more often than ``dask_services.restarts`` allows."""


class OutputLostError(ServiceError):
    """A produced output was asked for on a worker that does not hold it."""


class OutputsNotProducedError(OutputLostError):
    """Every hook of a run returned and wanted outputs were not produced: on a cluster once
    ``dask_services.unproduced-timeout`` passed without any output produced, under dask's
    local schedulers once nothing of the run is left to run."""
