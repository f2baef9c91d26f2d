"""The objects a caller holds of a deployed service: its endpoints (``svc.<endpoint>``),
the calls under way (``Call``), sessions that stick to one replica, and the peers a replica
sees (``self.peers``).  Each one turns what the caller wrote into a call of the handle
(``_handle.ReplicatedService._call``), which routes, sends and retries it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import inspect
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from dask_services._lazy_arguments import lazy_arguments
from dask_services.replicated._background import consume
from dask_services.replicated._options import endpoint_spec
from dask_services.replicated._streaming import Stream
from dask_services.replicated._transport import ClientTransport, Transport
from dask_services.service import ServiceId

if TYPE_CHECKING:
    from dask_services.replicated._handle import ReplicatedService

_session: contextvars.ContextVar[Session | None] = contextvars.ContextVar(
    "dask_services_replicated_session", default=None)


# ------------------------------------------------------------------ calls


class Call:
    """One call (or fan-out) under way: ``await call`` in async code, ``call.result()``
    otherwise."""

    def __init__(self, transport: Transport, coro: Coroutine, what: str) -> None:
        self._what = what
        self._task: asyncio.Future | None = None
        self._cf: concurrent.futures.Future | None = None
        if transport.in_loop():
            self._task = asyncio.ensure_future(coro)
            self._task.add_done_callback(consume)  # no "never retrieved" noise if dropped
        else:
            self._cf = asyncio.run_coroutine_threadsafe(coro, transport.loop)

    def __await__(self) -> Any:
        if self._task is not None:
            return self._task.__await__()
        assert self._cf is not None
        return asyncio.wrap_future(self._cf).__await__()

    def result(self, timeout: float | None = None) -> Any:
        """Wait (at most ``timeout`` seconds) and return the result or raise the error."""
        if self._task is not None:
            if not self._task.done():
                raise RuntimeError(f"{self._what}: in async code, `await` the call instead "
                                   "of calling .result()")
            return self._task.result()
        assert self._cf is not None
        try:
            return self._cf.result(timeout)
        except concurrent.futures.TimeoutError:
            if self._cf.done():  # the call's own TimeoutError (the same class on 3.11+)
                raise
            raise TimeoutError(f"{self._what} did not finish within {timeout} s") from None

    def cancel(self) -> bool:
        """Stop the call on the caller's side, as ``task.cancel()`` does in async code:
        one not yet sent is never sent; one a replica has taken runs to its end there and
        its answer is dropped (a replica does not watch its callers' connections).
        ``result()`` then raises ``CancelledError``.  False if it had already finished."""
        fut = self._task if self._task is not None else self._cf
        return fut.cancel()  # type: ignore[union-attr]

    def done(self) -> bool:
        """Whether the call has finished."""
        fut = self._task if self._task is not None else self._cf
        return fut.done()  # type: ignore[union-attr]

    def __repr__(self) -> str:
        return f"<Call {self._what} {'done' if self.done() else 'pending'}>"


class Endpoint:
    """``svc.<endpoint>``: ``route(...)``, ``fanout(...)`` and ``submit(...)``."""

    def __init__(self, handle: ReplicatedService, name: str) -> None:
        self._handle = handle
        self.name = name

    def _check_call(self, args: tuple, kwargs: dict) -> None:
        spec = endpoint_spec(self._handle.service_class, self.name)
        if spec.stream:
            raise TypeError(f"{self.name!r} is a streaming endpoint (a generator): iterate "
                            f"over svc.{self.name}.stream(...) instead")
        if spec.batched and (len(args) != 1 or kwargs):
            raise TypeError(f"{self.name!r} is a batched endpoint: each call passes exactly "
                            f"one request, svc.{self.name}.route(request)")

    def _check_values(self, args: tuple, kwargs: dict, how: str) -> None:
        # (the arguments themselves only: a call's payload is not walked on every call)
        lazy = lazy_arguments(args, kwargs, deep=False)
        if lazy:
            raise TypeError(
                f"{', '.join(lazy)} of svc.{self.name}.{how}(): route(), fanout() and "
                f"stream() send their arguments as they are (looking at the arguments "
                f"themselves, not into them), nothing computes them; pass the value "
                f"(future.result()), or call svc.{self.name}.submit(...), a task whose "
                f"future arguments are resolved first")

    def route(self, *args: Any, **kwargs: Any) -> Call:
        """Send one call to one healthy replica, chosen by the router (or the session)."""
        self._check_call(args, kwargs)
        self._check_values(args, kwargs, "route")
        h = self._handle
        session = _session.get()
        if session is not None and session.handle is not h:
            session = None
        return Call(h._transport, h._call(self.name, args, kwargs, session=session),
                    f"{h.name}.{self.name}")

    def stream(self, *args: Any, **kwargs: Any) -> Stream:
        """Iterate over what a generator endpoint yields on one replica (routed like
        ``route``): ``async for x in svc.gen.stream(...)`` in async code, ``for x in ...``
        otherwise.  Stopping early (break, ``close()``, cancelling) stops the generator."""
        if not endpoint_spec(self._handle.service_class, self.name).stream:
            raise TypeError(f"{self.name!r} is not a streaming endpoint (a generator): call "
                            f"it with svc.{self.name}.route(...)")
        self._check_values(args, kwargs, "stream")
        h = self._handle
        session = _session.get()
        if session is not None and session.handle is not h:
            session = None
        return Stream(h, self.name, args, kwargs, session)

    def fanout(self, *args: Any, **kwargs: Any) -> Call:
        """Call every healthy replica; the result is the list of their results."""
        self._check_call(args, kwargs)
        self._check_values(args, kwargs, "fanout")
        h = self._handle
        return Call(h._transport, h._fanout(self.name, args, kwargs),
                    f"{h.name}.{self.name} (fan-out)")

    def submit(self, *args: Any, client: Any = None, **kwargs: Any) -> Any:
        """A ``distributed.Future`` of one routed call (futures as arguments are resolved
        first; the result can be an argument of other submits and calls)."""
        from distributed import get_client

        self._check_call(args, kwargs)
        lazy = lazy_arguments(args, kwargs, deep=False, futures=False)
        if lazy:
            raise TypeError(
                f"{', '.join(lazy)} of svc.{self.name}.submit(): submit() resolves "
                f"futures among its arguments, as client.submit does, not Delayed objects "
                f"or collections; pass client.compute(x) instead, or the value")
        h = self._handle
        if client is None:
            transport = h._transport
            client = (transport.client if isinstance(transport, ClientTransport)
                      else get_client())
        key = f"{h.name}.{self.name}-{uuid.uuid4().hex}"
        return client.submit(_run_endpoint, h, self.name, kwargs, *args, key=key, pure=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"call a deployed endpoint with svc.{self.name}.route(...), "
                        f".fanout(...) or .submit(...)")

    def __repr__(self) -> str:
        return f"<Endpoint {self._handle.name}.{self.name}>"


async def _run_endpoint(handle: ReplicatedService, method: str, kwargs: dict,
                        *args: Any) -> Any:
    """Body of ``Endpoint.submit`` on a worker."""
    return await handle._call(method, args, kwargs, session=None)


class Session:
    """Calls made inside ``with svc.session():`` go to one replica (sticky).

    The replica is the least-loaded one when the first call is made; if it is lost, the
    session moves to another healthy replica and sticks to that one.
    """

    def __init__(self, handle: ReplicatedService) -> None:
        self.handle = handle
        self.replica: ServiceId | None = None
        self._token: contextvars.Token | None = None

    def bind(self, replica: ServiceId | None) -> None:
        """Stick to ``replica`` (None: choose again at the next call)."""
        counts = self.handle._session_counts
        if self.replica is not None:
            counts[self.replica] -= 1
            if counts[self.replica] <= 0:
                del counts[self.replica]
        self.replica = replica
        if replica is not None:
            counts[replica] += 1

    def __enter__(self) -> Session:
        self._token = _session.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._token is not None:
            _session.reset(self._token)
            self._token = None
        self.bind(None)

    async def __aenter__(self) -> Session:
        return self.__enter__()

    async def __aexit__(self, *exc: Any) -> None:
        self.__exit__(*exc)


class ReplicaPeers(Mapping):
    """``self.peers`` of a replica: the healthy replicas as its handle last saw them.

    ``await self.peers[sid].endpoint(*args)`` calls that very replica.
    """

    def __init__(self, handle: ReplicatedService,
                 own: tuple[ServiceId, Any] | None = None) -> None:
        self._handle = handle
        self._own = own  # (id, service) of the replica these are the peers of

    def _ids(self) -> list[ServiceId]:
        h = self._handle
        if time.monotonic() > h._stale_at and not h._transport.in_loop():
            # a sync endpoint, in a replica's thread: wait for the table (the loop's
            # background refresh never runs from here)
            with contextlib.suppress(Exception):  # a shut-down service: its calls say so
                h._transport.sync(h._refresh)
        else:
            h._maybe_refresh()
        return [r.id for r in h._table if r.state == "healthy"]

    def __getitem__(self, sid: ServiceId) -> PeerEndpoints:
        if sid not in self._ids():
            raise KeyError(sid)
        if self._own is not None and sid == self._own[0]:
            return OwnEndpoints(self._handle, ServiceId(sid), self._own[1])
        return PeerEndpoints(self._handle, ServiceId(sid))

    def __iter__(self) -> Iterator[ServiceId]:
        return iter(self._ids())

    def __len__(self) -> int:
        return len(self._ids())


class PeerEndpoints:
    """Endpoints of one given replica: ``await peer.method(*args)``."""

    def __init__(self, handle: ReplicatedService, sid: ServiceId) -> None:
        self._handle = handle
        self.id = sid

    def __getattr__(self, name: str) -> Callable[..., Call]:
        self._handle._check_endpoint(name)

        def call(*args: Any, **kwargs: Any) -> Call:
            h = self._handle
            return Call(h._transport, h._call(name, args, kwargs, pin=self.id),
                        f"{h.name}.{name} on {self.id}")

        return call


class OwnEndpoints(PeerEndpoints):
    """``self.peers[self.id]``: a replica calling its own endpoint runs it at once, in
    this process and outside its ``max_concurrency`` (through its worker, the call would
    wait for the slot its caller holds: a replica of ``max_concurrency=1`` iterating over
    ``self.peers`` would wait for ever).  Batched and streaming endpoints go through the
    worker as another peer's calls do."""

    def __init__(self, handle: ReplicatedService, sid: ServiceId, service: Any) -> None:
        super().__init__(handle, sid)
        self._service = service

    def __getattr__(self, name: str) -> Callable[..., Call]:
        self._handle._check_endpoint(name)
        spec = endpoint_spec(type(self._service), name)
        if spec.batched or spec.stream:
            return super().__getattr__(name)
        fn = getattr(self._service, name)

        async def run(args: tuple, kwargs: dict) -> Any:
            if inspect.iscoroutinefunction(fn):  # (asyncio's is deprecated in 3.14)
                return await fn(*args, **kwargs)
            return await asyncio.to_thread(fn, *args, **kwargs)

        def call(*args: Any, **kwargs: Any) -> Call:
            h = self._handle
            return Call(h._transport, run(args, kwargs), f"{h.name}.{name} on {self.id}")

        return call
