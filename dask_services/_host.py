"""Hosting instances: lifecycle hooks, the concierge, peer handles and ordered peer RPC.

One :class:`ServiceHost` per worker (``worker.py``) or per in-process run (``local.py``).
The host knows nothing about networks or schedulers: it talks to its environment through
an :class:`Environment` (report hooks, produce outputs, send RPCs to other hosts).
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import dask.config
from dask.typing import Key
from dask.utils import parse_timedelta

from dask_services._buffers import IncomingBuffers, as_incoming, buffers_of
from dask_services._counters import Traffic, size_of
from dask_services._directory import in_directory, remove_if_empty
from dask_services._known_sizes import checked_nbytes, remember
from dask_services._messages import (
    callable_name,
    contained,
    raise_future_safe,
    without_stop_iteration,
)
from dask_services._payload import known_arguments_nbytes
from dask_services._threads import LateJobWatch, cancel_unstarted
from dask_services.config import setting
from dask_services.service import (
    INSTANCE_ATTRIBUTES,
    Concierge,
    PeerUnreachableError,
    ProduceKeyError,
    RPCRefused,
    Service,
    ServiceError,
    ServiceId,
    StaleRunError,
    is_rpc_method,
    refuse_own_values,
)

logger = logging.getLogger("dask_services")
T = TypeVar("T")

# How long a stopping instance waits for answers to the peer calls it has on the wire.
OUTGOING_CALLS_GRACE = 5.0


def read_only(data: Any) -> Any:
    """``data`` as ``add_key`` gets it: a writeable numpy array as a read-only view (see
    the hook order in ``design/architecture.md``); other types as they are (pandas objects
    copy on write from pandas 3 on)."""
    np = sys.modules.get("numpy")  # not imported: no array can be here
    if np is not None and type(data) is np.ndarray and data.flags.writeable:
        data = data.view()
        data.flags.writeable = False
    return data


@dataclass(frozen=True)
class InstanceSpec:
    """What the scheduler tells one instance about its run."""

    service_key: Key
    run_id: int
    id: ServiceId
    peers: Mapping[ServiceId, str]  # id -> address of the host holding it
    input_keys: Sequence[Key]
    output_keys: Sequence[Key]
    wanted: Sequence[Key]
    owners: Mapping[Key, ServiceId]
    leader: ServiceId
    service_class: type[Service]
    params: Mapping[str, Any]
    # distributed's span of the service task (``distributed.span``), which the time of the
    # instance's thread jobs is reported under; None where there is none
    span_id: str | None = None


class Environment(abc.ABC):
    """What a host needs from the place it lives in."""

    address: str
    local_directory: str
    memory_limit: int | None
    memory_to_plan_on: int  # the limit, or without one what "auto" would give

    @abc.abstractmethod
    def started(self, spec: InstanceSpec) -> None: ...

    def thread_time_used(self, spec: InstanceSpec, cpu: float, wall: float) -> None:
        """A job of the instance ran in a service thread for ``wall`` seconds, ``cpu`` of
        them on a CPU (called on the loop)."""

    @abc.abstractmethod
    def failed(self, spec: InstanceSpec, exc: BaseException) -> None: ...

    @abc.abstractmethod
    def restart(self, spec: InstanceSpec, reason: str) -> None: ...

    @abc.abstractmethod
    def produced(self, spec: InstanceSpec, key: Key, value: Any) -> None: ...

    def hooks_returned(self, spec: InstanceSpec) -> None:
        """The instance's ``all_inputs_done`` returned without failing."""

    @abc.abstractmethod
    async def send_rpc(
        self, address: str, target: ServiceId, source: ServiceId, run_id: int, seq: int,
        method: str, args: tuple, kwargs: dict,
    ) -> Any: ...

    @abc.abstractmethod
    def run_in_executor(self, fn: Callable[..., T], *args: Any,
                        jobs: set[concurrent.futures.Future[Any]] | None = None
                        ) -> asyncio.Future[T]:
        """``fn(*args)`` submitted to the services' threads now (on the running loop);
        the job is kept in ``jobs`` until it returns."""

    def let_go_of_jobs(self, jobs: set[concurrent.futures.Future[Any]]) -> int:
        """The instance that submitted ``jobs`` stopped: those not started are cancelled.
        Returns how many still run."""
        return len(cancel_unstarted(jobs))

    async def memory_backpressure(self) -> None:
        """Return once the place has memory to take more produced outputs."""


@dataclass(eq=False)
class Instance:
    """A live instance and the framework's bookkeeping around it."""

    spec: InstanceSpec
    service: Service
    directory: str
    started: asyncio.Event = field(default_factory=asyncio.Event)
    all_started_returned: asyncio.Event = field(default_factory=asyncio.Event)
    stopping: bool = False
    produced: set[Key] = field(default_factory=set)
    inputs: set[Key] = field(default_factory=set)  # input keys handed to add_key
    input_sizes: dict[Key, int] = field(default_factory=dict)  # measured, while in add_key
    hooks: dict[asyncio.Task, str] = field(default_factory=dict)  # running hook -> name
    next_seq_out: dict[ServiceId, int] = field(default_factory=dict)
    next_seq_in: dict[ServiceId, int] = field(default_factory=dict)
    inbox: asyncio.Condition = field(default_factory=asyncio.Condition)
    traffic: Traffic = field(default_factory=Traffic)  # bytes of its peer calls
    outgoing: set[asyncio.Future] = field(default_factory=set)  # its peer calls on the wire
    # its concierge.run_in_executor jobs not returned yet
    jobs: set[concurrent.futures.Future] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.output_key_set = frozenset(self.spec.output_keys)


class InstanceConcierge(Concierge):
    def __init__(self, host: ServiceHost, instance: Instance) -> None:
        self._host = host
        self._instance = instance
        self._positions: dict[Key, int] | None = None  # output key -> position, for owner()
        # the loop that owns the run's state: error() and restart() called from a service
        # thread are carried out there
        self._loop = asyncio.get_running_loop()

    def _is_on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:  # a thread without an event loop
            return False

    def _on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._is_on_loop():
            fn(*args)
        else:
            self._loop.call_soon_threadsafe(fn, *args)

    @property
    def run_id(self) -> int:
        return self._instance.spec.run_id

    @property
    def address(self) -> str:
        return self._host.env.address

    @property
    def local_directory(self) -> str:
        return self._instance.directory

    @property
    def memory_limit(self) -> int | None:
        return self._host.env.memory_limit

    @property
    def memory_to_plan_on(self) -> int:
        return self._host.env.memory_to_plan_on

    @property
    def wanted_outputs(self) -> Sequence[Key]:
        return self._instance.spec.wanted

    def owner(self, output_key: Key) -> ServiceId:
        spec = self._instance.spec
        owner = spec.owners.get(output_key)
        if owner is not None:
            return owner
        # An output this run does not need (a partial compute): an owner all the same,
        # the same on every instance, so that "produce every output I own" works (producing
        # it is a no-op).
        if self._positions is None:
            self._positions = {key: i for i, key in enumerate(spec.output_keys)}
        position = self._positions.get(output_key)
        if position is None:
            raise ProduceKeyError(
                f"{output_key!r} is not an output of service task {spec.service_key!r}; "
                "its outputs are self.output_keys"
            )
        ids = list(spec.peers)
        return ids[position % len(ids)]

    def produce_key(self, key: Key, value: Any, *, nbytes: int | None = None
                    ) -> Coroutine[Any, Any, bool]:
        # Produced at once, in the call: the coroutine returned only waits for memory. An
        # output whose ``await`` was forgotten is produced all the same (with Python's
        # "never awaited" warning) rather than waited for by its dependents for ever.
        # Called off the run's event loop (a service thread making the coroutine for
        # ``asyncio.run_coroutine_threadsafe``), the output is produced where the coroutine
        # runs: the run's state and the worker's streams belong to the loop's thread.
        if not self._is_on_loop():
            return self._produce_key_on_loop(key, value, nbytes)
        return self._produce_key_awaited(self._produce(key, value, nbytes))

    async def _produce_key_awaited(self, kept: bool) -> bool:
        if kept:
            await self._host.env.memory_backpressure()
        return kept

    async def _produce_key_on_loop(self, key: Key, value: Any, nbytes: int | None) -> bool:
        return await self._produce_key_awaited(self._produce(key, value, nbytes))

    def _produce(self, key: Key, value: Any, nbytes: int | None) -> bool:
        if nbytes is not None:
            nbytes = checked_nbytes(nbytes)
        inst = self._instance
        if inst.stopping:
            raise StaleRunError(
                f"instance {inst.spec.id} of {inst.spec.service_key!r} is stopped; "
                "it can no longer produce outputs"
            )
        if isinstance(key, list):  # a tuple key passed as a list: not a key, unhashable
            raise ProduceKeyError(
                f"{key!r} is not an output of service task {inst.spec.service_key!r}: keys "
                "are strings or tuples; produce one of self.output_keys as it is")
        if key not in inst.spec.owners:
            if key in inst.output_key_set:
                # An output this run was not started for (culled, in memory, or released):
                # wanted-ness changes under a run, so a service cannot be asked to know it.
                logger.debug("%s: output %r of %r is not wanted by run %d; value dropped",
                             inst.spec.id, key, inst.spec.service_key, inst.spec.run_id)
                return False
            outputs = list(inst.spec.output_keys)
            raise ProduceKeyError(
                f"{key!r} is not an output of service task {inst.spec.service_key!r}; "
                f"its outputs are {outputs[:5]!r}{'...' if len(outputs) > 5 else ''}"
            )
        if key in inst.produced:
            raise ProduceKeyError(f"output {key!r} was already produced by {inst.spec.id}")
        inst.produced.add(key)
        if nbytes is not None:
            remember(value, nbytes)
        self._host.env.produced(inst.spec, key, value)
        return True

    def input_nbytes(self, key: Key) -> int | None:
        return self._instance.input_sizes.get(key)

    def error(self, exc: BaseException) -> None:
        if not isinstance(exc, BaseException):
            raise TypeError(
                f"concierge.error() takes an exception, e.g. "
                f"concierge.error(ValueError({exc!r})); got a {type(exc).__name__}")
        if not isinstance(exc, Exception):
            # a SystemExit, KeyboardInterrupt or CancelledError raised where the service
            # task waits would stop its worker, or end the task without a result
            cause, exc = exc, RuntimeError(
                f"concierge.error() was given {exc!r}, which is not an Exception: "
                "raised in the service task, it would stop its worker or end the task "
                "without a result; pass an Exception to fail the run")
            exc.__cause__ = cause
        self._on_loop(self._host.env.failed, self._instance.spec, exc)

    def restart(self, reason: str = "restart requested by the service") -> None:
        self._on_loop(self._host.env.restart, self._instance.spec, reason)

    def run_in_executor(self, fn: Callable[..., T], *args: Any, **kwargs: Any
                        ) -> Coroutine[Any, Any, T]:
        # Submitted in the call, as ``loop.run_in_executor`` does: a forgotten ``await``
        # still runs ``fn`` (with Python's "never awaited" warning, and asyncio's "never
        # retrieved" one if it raised) rather than never. Off the instance's loop (a
        # service thread with a loop of its own) it is submitted where it is awaited.
        # (a StopIteration it raises fails the run as a RuntimeError: asyncio cannot set
        # one on the future awaited, which would never be done, and the run would hang)
        call = self._timed(without_stop_iteration(functools.partial(fn, *args, **kwargs),
                                                  f"{callable_name(fn)} given to "
                                                  "concierge.run_in_executor"))
        if not self._is_on_loop():
            return self._run_in_executor_later(call)
        return _awaited(self._host.env.run_in_executor(call, jobs=self._instance.jobs))

    def _timed(self, call: Callable[[], T]) -> Callable[[], T]:
        """``call``, telling the environment the time it took (the worker reports it to
        distributed's spans, as p2p reports its work: the shuffle's split and the rechunk's
        assembly run here, outside any task)."""
        spec = self._instance.spec
        if spec.span_id is None:
            return call

        def timed() -> T:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return call()
            finally:
                used = (time.thread_time() - cpu, time.perf_counter() - wall)
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    self._on_loop(self._host.env.thread_time_used, spec, *used)
        return timed

    async def _run_in_executor_later(self, call: Callable[[], T]) -> T:
        return await self._host.env.run_in_executor(call, jobs=self._instance.jobs)


class PeerHandle:
    """``await handle.method(*args, **kwargs)`` calls ``method`` on instance ``id``."""

    __slots__ = ("_host", "_source", "id")

    def __init__(self, host: ServiceHost, source: Instance, target: ServiceId) -> None:
        self._host = host
        self._source = source
        self.id = target

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise RPCRefused(
                f"peer method {name!r} refused: private names cannot be called on peers"
            )

        def call(*args: Any, **kwargs: Any) -> Any:
            cls = type(self._source.service)
            if not self._source.started.is_set():
                # only start() (or what it started) runs before the instance has started
                return _raise(ServiceError(
                    f"peer method {name!r} called before {cls.__name__}.start() returned "
                    "(from start() or what it started): a peer answers only once its own "
                    "start() has returned, and every instance's start() may be waiting in "
                    "the same way; make peer calls in all_started() or later (every "
                    "instance has started then)"))
            if not is_rpc_method(cls, name):
                # Refused before it takes a sequence number: the channel stays as it was.
                return _raise(RPCRefused(_refusal(cls, name)))
            try:
                buffers_of(args, kwargs)  # at most one Buffers argument, on every path
            except TypeError as exc:
                return _raise(exc)
            return _started_call(self, name, args, kwargs)

        call.__name__ = name
        return call

    def __repr__(self) -> str:
        return f"<PeerHandle {self.id}>"


class ServiceHost:
    """The instances living in one place (a worker, or one in-process run)."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.instances: dict[ServiceId, Instance] = {}
        # service key -> the most recent instance started here
        self.current: dict[Key, Instance] = {}
        self.latest_run = -1  # of any instance created here
        self._creation = asyncio.Event()  # set (and replaced) whenever one is created
        self.late_jobs = LateJobWatch()  # jobs of stopped instances, warned about if late

    # ------------------------------------------------------------- lifecycle

    def create(self, spec: InstanceSpec) -> Instance:
        """Create the instance at once (so that hand-offs find it); start it later."""
        # first: a class that cannot be made, or whose attributes cannot be set (a
        # read-only property named like one of them), leaves nothing
        service = spec.service_class()
        refuse_own_values(service, INSTANCE_ATTRIBUTES,
                          "every instance of a service task")
        service.id = spec.id
        service.key = spec.service_key
        service.input_keys = tuple(spec.input_keys)
        service.output_keys = tuple(spec.output_keys)
        service.leader = spec.leader
        service.params = dict(spec.params)
        directory = in_directory(self.env.local_directory, lambda: tempfile.mkdtemp(
            prefix=f"{spec.id}-".replace("/", "_"), dir=self.env.local_directory
        ))
        try:
            inst = Instance(spec=spec, service=service, directory=directory)
            service.concierge = InstanceConcierge(self, inst)
            service.peers = {sid: PeerHandle(self, inst, sid) for sid in spec.peers}
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            remove_if_empty(self.env.local_directory)
            raise
        self.instances[spec.id] = inst
        self.current[spec.service_key] = inst
        # start messages reach a worker in run order: a lower run can no longer come
        self.latest_run = max(self.latest_run, spec.run_id)
        self._creation.set()
        self._creation = asyncio.Event()
        return inst

    async def created(self, target: ServiceId, run_id: int) -> Instance | None:
        """The instance ``target`` once created here; None if a later run came first or it
        did not come within the connect timeout."""
        timeout = parse_timedelta(dask.config.get("distributed.comm.timeouts.connect", "30s"))
        deadline = asyncio.get_running_loop().time() + timeout
        while target not in self.instances and run_id > self.latest_run:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return None
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._creation.wait(), remaining)
        return self.instances.get(target)

    async def start(self, inst: Instance) -> None:
        s = inst.service
        ok = await self._hook(
            inst,
            s.start,
            (s.id, s.key, s.peers, s.input_keys, s.output_keys, s.concierge, s.leader),
            dict(inst.spec.params),  # any names (fn, inst, ...): not this method's own
            wait_started=False, own_task=True,
        )
        if ok:
            inst.started.set()
            self.env.started(inst.spec)

    async def all_started(self, sid: ServiceId) -> None:
        inst = self.instances.get(sid)
        if inst is not None:
            if await self._hook(inst, inst.service.all_started, own_task=True):
                inst.all_started_returned.set()

    async def all_inputs_done(self, sid: ServiceId) -> None:
        """Runs after ``all_started`` has returned on this instance."""
        inst = self.instances.get(sid)
        if inst is not None and await self._hook(inst, self._all_inputs_done, (inst,),
                                                 own_task=True):
            self.env.hooks_returned(inst.spec)

    async def _all_inputs_done(self, inst: Instance) -> None:
        await inst.all_started_returned.wait()
        await _called(inst.service.all_inputs_done, (), {},
                      _named(inst.service, "all_inputs_done"))

    async def add_key(self, sid: ServiceId, key: Key, data: Any,
                      still_wanted: Callable[[], bool] = lambda: True,
                      nbytes: int | None = None) -> bool:
        """Hand one input to instance ``sid``; False if it is gone, the hook failed, or
        ``still_wanted()`` says no once the instance has started.  An instance takes each
        input key once: a second hand-off of the same key is a no-op.  ``nbytes``: the
        input's size if measured (``Concierge.input_nbytes`` while ``add_key`` runs)."""
        inst = self.instances.get(sid)
        if inst is None or inst.stopping:
            return False

        async def add() -> None:
            if key in inst.inputs or not still_wanted():
                return
            inst.inputs.add(key)
            if nbytes is not None:
                inst.input_sizes[key] = nbytes
            given = read_only(data)
            try:
                await _called(inst.service.add_key, (key, given), {},
                              _named(inst.service, "add_key"))
            except ValueError as e:
                if given is not data and "read-only" in str(e):
                    e.add_note(f"(add_key of {type(inst.service).__name__} for {key!r}: "
                               "a numpy array handed to add_key is the graph's value, "
                               "shared with every task that uses the key, so it comes "
                               "read-only; change a copy: data = data.copy())")
                raise
            finally:
                inst.input_sizes.pop(key, None)

        return await self._hook(inst, add) and key in inst.inputs

    async def stop(self, sid: ServiceId) -> None:
        inst = self.instances.get(sid)
        if inst is None or inst.stopping:
            return
        inst.stopping = True
        grace = stop_grace()
        current = asyncio.current_task()
        pending = {t: name for t, name in inst.hooks.items() if t is not current}
        for t in pending:
            t.cancel()
        if pending:
            done, stuck = await asyncio.wait(pending, timeout=grace)
            for t in done:
                if not t.cancelled():
                    t.exception()  # retrieved: the instance stops whatever the hook did
            if stuck:
                # a hook that catches its own cancellation (or blocks on something that
                # never comes) must not keep the instance, its memory and its directory
                logger.warning(
                    "%s of %s (%r): %s still running %s s after being cancelled (does it "
                    "catch asyncio.CancelledError?); the instance stops without it",
                    type(inst.service).__name__, sid, inst.spec.service_key,
                    ", ".join(sorted({pending[t] + "()" for t in stuck})), grace)
        if self.env.let_go_of_jobs(inst.jobs):
            label = f"{type(inst.service).__name__} of {sid} ({inst.spec.service_key!r})"

            def warn(running: int) -> None:
                logger.warning(
                    "%s: %d concierge.run_in_executor job(s) still running %g s after "
                    "the instance stopped (a thread cannot be stopped); each keeps a "
                    "service thread until it returns, and another was started meanwhile "
                    "so that later runs do not wait for it", label, running, grace)

            self.late_jobs.watch(inst.jobs, grace, warn)
        async with inst.inbox:
            inst.inbox.notify_all()
        if inst.outgoing:
            # peer calls already sent: answered at once (taken, or refused by an instance
            # that stops too), unless their peer is gone
            await asyncio.wait(set(inst.outgoing), timeout=OUTGOING_CALLS_GRACE)
            for call in list(inst.outgoing):
                call.cancel()
        try:
            stopped = asyncio.ensure_future(_stopped(inst.service))
            await asyncio.wait({stopped}, timeout=grace)
            if not stopped.done():
                stopped.cancel()
                logger.warning("stop() of %s (%r) did not return within %s s; the instance "
                               "is let go without it", sid, inst.spec.service_key, grace)
            elif not stopped.cancelled() and stopped.exception() is not None:
                logger.error("stop() of %s (%r) raised", sid, inst.spec.service_key,
                             exc_info=stopped.exception())
        finally:
            shutil.rmtree(inst.directory, ignore_errors=True)
            remove_if_empty(self.env.local_directory)
            del self.instances[sid]
            if self.current.get(inst.spec.service_key) is inst:
                del self.current[inst.spec.service_key]

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(sid) for sid in list(self.instances)))

    async def _hook(
        self, inst: Instance, fn: Callable[..., Any], args: tuple = (),
        kwargs: dict | None = None, *, wait_started: bool = True, own_task: bool = False,
    ) -> bool:
        """Run one hook, ``fn(*args, **kwargs)``; report an exception as the failure of the
        run.  ``own_task``: the hook runs in a task of the framework's own, which nothing
        but the instance's stop cancels (a hand-off's ``add_key`` runs in the hand-off
        task, which distributed cancels when it releases it)."""
        if inst.stopping:
            return False
        task = asyncio.current_task()
        assert task is not None
        inst.hooks[task] = _hook_name(fn)
        try:
            if wait_started:
                await inst.started.wait()
            await _called(fn, args, kwargs or {}, _named(inst.service, _hook_name(fn)))
            return True
        except asyncio.CancelledError as exc:
            if inst.stopping:
                return False
            if task.cancelling():  # this hook was cancelled
                if own_task:
                    # not by the framework, which stops the instance first: by the
                    # service's own code (asyncio.current_task().cancel(), ...)
                    self.env.failed(inst.spec, RuntimeError(
                        f"{_named(inst.service, _hook_name(fn))} was cancelled while its "
                        "instance was not stopping, by the service's own code (did it "
                        "cancel the task it runs in?); raise an exception to fail the run"))
                raise
            # the service's own code let a CancelledError out (it awaited a task it had
            # cancelled): a failure like any other exception, not a cancellation
            error = RuntimeError(
                f"{type(inst.service).__name__}.{_hook_name(fn)}() raised "
                "asyncio.CancelledError without being cancelled (an awaited task was "
                "cancelled?); catch it in the hook, or raise another exception")
            error.__cause__ = exc
            self.env.failed(inst.spec, error)
            return False
        except Exception as exc:
            if not inst.stopping:
                lost = _peer_lost(exc)
                if lost is not None:  # the peer's worker is gone: as its loss does
                    self.env.restart(inst.spec, str(lost))
                else:
                    self.env.failed(inst.spec, exc)
            return False
        except BaseException as exc:  # SystemExit, KeyboardInterrupt... raised by the hook
            if not inst.stopping:
                self.env.failed(inst.spec, contained(exc, _named(inst.service, _hook_name(fn))))
            return False
        finally:
            inst.hooks.pop(task, None)

    # ------------------------------------------------------------- peer RPC

    async def call_peer(
        self, source: Instance, target: ServiceId, seq: int, method: str,
        args: tuple, kwargs: dict,
    ) -> Any:
        if source.stopping:
            raise StaleRunError(f"instance {source.spec.id} is stopped")
        try:
            address = source.spec.peers[target]
        except KeyError:
            raise StaleRunError(
                f"{target!r} is not a peer of {source.spec.id} in run "
                f"{source.spec.run_id} of {source.spec.service_key!r}"
            ) from None
        run_id = source.spec.run_id
        if address == self.env.address:
            # Loopback: no serialization, same ordering guarantees; bytes counted by sizeof.
            async def arguments() -> tuple[tuple, dict]:
                self._count(source, self.instances.get(target), known_or_size_of(args, kwargs))
                return args, kwargs

            result = await self.deliver(target, source.spec.id, run_id, seq, method,
                                        arguments)
            if result is not None:
                self._count(self.instances.get(target), source, size_of(result))
            return result
        # A call on the wire runs to its answer even when its caller is cancelled (the
        # instance stopping): the receiver either took it (and counted its bytes) or refused
        # it (and the sender takes its count back), never half of it (_counters.py).
        call = asyncio.ensure_future(self.env.send_rpc(
            address, target, source.spec.id, run_id, seq, method, args, kwargs))
        source.outgoing.add(call)
        call.add_done_callback(functools.partial(_call_answered, source.outgoing))
        return await asyncio.shield(call)

    async def deliver(
        self, target: ServiceId, source: ServiceId, run_id: int, seq: int, method: str,
        arguments: Callable[[], Awaitable[tuple[tuple, dict]]],
    ) -> Any:
        """Run ``method`` on instance ``target`` (of run ``run_id``), starting calls from one
        peer in order.  A call may arrive before this host has created its instance of a
        new run (the start message to this worker lags): it waits for it.

        Once a call has taken its turn, whatever becomes of it (a refused method, arguments
        that ``arguments()`` cannot deserialize, an exception in the method) the next call
        from the same peer goes on: every error is the caller's, never the channel's."""
        inst = self.instances.get(target)
        if inst is None and run_id > self.latest_run:
            inst = await self.created(target, run_id)
        if inst is None or inst.stopping:
            raise StaleRunError(
                f"no instance {target} here: the run it belonged to is no longer current"
            )
        if source not in inst.spec.peers:
            raise StaleRunError(f"{source!r} is not a peer of {target} in this run")
        async with inst.inbox:
            await inst.inbox.wait_for(
                lambda: inst.stopping or inst.next_seq_in.get(source, 0) == seq
            )
            if inst.stopping:
                raise StaleRunError(f"instance {target} stopped")
            inst.next_seq_in[source] = seq + 1
            inst.inbox.notify_all()
        # The turn is taken: from here on a failure is this call's alone.
        cls = type(inst.service)
        if not is_rpc_method(cls, method):
            raise RPCRefused(_refusal(cls, method))
        task = asyncio.current_task()
        assert task is not None
        inst.hooks[task] = method
        args: tuple = ()
        kwargs: dict = {}
        try:
            # a Buffers argument reaches the method as IncomingBuffers (_buffers.py)
            args, kwargs = as_incoming(*await arguments())
            await inst.started.wait()
            try:
                return await _called(getattr(inst.service, method), args, kwargs,
                                     _named(inst.service, method))
            except (Exception, asyncio.CancelledError):
                raise
            except BaseException as exc:  # SystemExit, KeyboardInterrupt...
                raise contained(exc, _named(inst.service, method)) from exc
        finally:
            inst.hooks.pop(task, None)
            for arg in (*args, *kwargs.values()):
                if isinstance(arg, IncomingBuffers):
                    arg.method_returned()  # read later, it would take the next call's bytes
                    # a copy the method gave up on (a timeout) writes on in a thread until
                    # told to stop: the caller may reuse its arrays once answered
                    await arg.stopped()

    @staticmethod
    def _count(sender: Instance | None, receiver: Instance | None, nbytes: int) -> None:
        """``nbytes`` went from ``sender`` to ``receiver`` (``_counters.Traffic``)."""
        if sender is not None:
            sender.traffic.bytes_sent += nbytes
        if receiver is not None:
            receiver.traffic.bytes_received += nbytes

    # ------------------------------------------------------------- memory

    def managed_bytes(self) -> int:
        return sum(_safe_sizeof(i.service) for i in self.instances.values())

    def spilled_bytes(self) -> int:
        total = 0
        for inst in self.instances.values():
            with contextlib.suppress(Exception):
                total += int(inst.service.spilled_bytes())
        return total

    async def evict(self, nbytes: int) -> None:
        """Ask instances, largest first, to free about ``nbytes`` in total."""
        by_size = sorted(self.instances.values(), key=lambda i: -_safe_sizeof(i.service))
        for inst in by_size:
            if nbytes <= 0:
                break
            size = _safe_sizeof(inst.service)
            if size <= 0 or not inst.started.is_set() or inst.stopping:
                continue
            await self._hook(inst, inst.service.please_evict, (min(size, nbytes),))
            nbytes -= size


def _refusal(cls: type, method: str) -> str:
    if not isinstance(method, str) or method.startswith("_"):
        return f"peer method {method!r} refused: private names cannot be called on peers"
    if not callable(getattr(cls, method, None)):
        rpcs = sorted(name for name in dir(cls) if is_rpc_method(cls, name))
        return (f"{cls.__name__} has no method {method!r} to call on peers (its @rpc "
                f"methods: {rpcs})")
    return (
        f"{cls.__name__}.{method} is not callable by peers: only methods marked with "
        "@dask_services.rpc are"
    )


async def _raise(exc: BaseException) -> Any:
    raise exc


def _named(service: Service, method: str) -> str:
    return f"{type(service).__name__}.{method}()"


async def _stopped(service: Service) -> None:
    """``service.stop()``, with what it raises contained (``contained``)."""
    try:
        await _called(service.stop, (), {}, _named(service, "stop"))
    except (Exception, asyncio.CancelledError):
        raise
    except BaseException as exc:
        raise contained(exc, _named(service, "stop")) from exc


async def _started_call(handle: PeerHandle, name: str, args: tuple, kwargs: dict) -> Any:
    """A peer call takes its sequence number when it starts (its first step, once awaited
    or made a task), not when its coroutine is made: a call made and never awaited, or
    awaited after one made later, would otherwise leave a number the receiver waits for
    before every later call of the channel."""
    source = handle._source
    seq = source.next_seq_out.get(handle.id, 0)
    source.next_seq_out[handle.id] = seq + 1
    return await handle._host.call_peer(source, handle.id, seq, name, args, kwargs)


def _call_answered(outgoing: set[asyncio.Future], call: asyncio.Future) -> None:
    outgoing.discard(call)
    if not call.cancelled():
        call.exception()  # retrieved: a caller cancelled meanwhile no longer wants it


def _safe_sizeof(service: Service) -> int:
    try:
        return int(service.__sizeof__())
    except Exception:
        return 0


def known_or_size_of(args: tuple, kwargs: dict) -> int:
    """The bytes of a peer call's arguments: as its caller said, else measured."""
    known = known_arguments_nbytes()
    return size_of((args, kwargs)) if known is None else known


def _peer_lost(exc: BaseException) -> PeerUnreachableError | None:
    """The ``PeerUnreachableError`` behind ``exc`` (itself, or what it was raised from)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, PeerUnreachableError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def stop_grace() -> float:
    """Seconds a stopping instance gives its cancelled hooks, then its ``stop()``."""
    return float(parse_timedelta(setting("stop-grace")))


def _hook_name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__name__", "hook")
    return {"add": "add_key", "_all_inputs_done": "all_inputs_done"}.get(name, name)


async def _awaited(result: Any) -> Any:
    """A hook's result, awaited where it is awaitable: a hook written as a plain ``def``
    has already run when it returns."""
    if inspect.isawaitable(result):
        return await result
    return result


async def _called(fn: Callable[..., Any], args: tuple, kwargs: dict, what: str) -> Any:
    """``fn(*args, **kwargs)``, awaited where awaitable; a generator function (a ``yield``
    in ``what``, named so), which calling would run none of, is refused."""
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(
            f"{what} is a generator function (a `yield` in its body), so calling it would "
            "run none of its body; hooks and @rpc methods run once: remove the `yield` "
            "(return a list instead)")
    try:
        return await _awaited(fn(*args, **kwargs))
    except (StopIteration, RuntimeError) as e:
        # a StopIteration (from a plain def, or turned by Python into "coroutine raised
        # StopIteration", which names nothing) as a RuntimeError naming the hook
        raise_future_safe(e, what, fails="the run")
