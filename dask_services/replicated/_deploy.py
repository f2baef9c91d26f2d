"""``Service.options(...).as_service(...)``: deploying a replicated service."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from distributed.protocol import pickle

from dask_services._config_check import check_config
from dask_services._lazy_arguments import computed_arguments, lazy_arguments
from dask_services._messages import loads_exception
from dask_services.replicated._background import consume
from dask_services.replicated._errors import DeploymentError, ServiceShutdown
from dask_services.replicated._handle import ReplicatedService, check_names
from dask_services.replicated._options import (
    REPLICA_ATTRIBUTES,
    ReplicaOptions,
    config_seconds,
    unconfigured,
)
from dask_services.replicated._transport import ClientTransport
from dask_services.service import Service, check_instance_attributes


def as_service(cls: type, args: tuple, kwargs: dict, client: Any = None) -> Any:
    """Deploy ``cls`` as configured by its ``service_options``; see ``Service.as_service``.

    Returns the handle, or (with an asynchronous client) an awaitable of it.
    """
    from distributed import default_client

    if not (isinstance(cls, type) and issubclass(cls, Service)):
        raise TypeError(f"expected a subclass of dask_services.Service, got {cls!r}")
    check_config()
    options = ReplicaOptions.merged(getattr(cls, "service_options", {}))
    base = unconfigured(cls)
    check_names(base)
    check_instance_attributes(base, REPLICA_ATTRIBUTES, "every replica")
    client = client or default_client()
    name = options.name or f"{base.__name__.lower()}-{uuid.uuid4().hex[:8]}"
    shipped = {"router": options.router}
    try:
        pickle.dumps(shipped)
    except Exception as e:
        raise TypeError(f"options(router=...) of {base.__name__} cannot be pickled (it is "
                        f"shipped to the workers that call the service): {e}") from e
    lazy = bool(lazy_arguments(args, kwargs))
    if lazy and not client.asynchronous:
        # futures, Delayed objects and collections among the setup arguments are
        # computed first: every replica (one autoscaling or a recovery starts later too)
        # is set up with their values
        args, kwargs = computed_arguments(client, args, kwargs,
                                          "the setup arguments of as_service()")
        lazy = False
    # (an asynchronous client's lazy arguments are computed, then pickled, as it deploys)
    blob = b"" if lazy else _setup_blob(base, args, kwargs, shipped)
    if not client.asynchronous:
        from dask_services.client import install

        install(client)
    transport = ClientTransport(client)
    handle = ReplicatedService(name, base, shipped, transport)
    setup = (args, kwargs, shipped) if lazy else None
    return transport.sync(_deploy, client, handle, blob, options, setup)


def _setup_blob(base: type, args: tuple, kwargs: dict, shipped: dict) -> bytes:
    try:
        return pickle.dumps((base, args, kwargs, shipped))
    except Exception as e:
        raise TypeError(f"the class {base.__name__} or the setup arguments of as_service() "
                        f"cannot be pickled: {e}") from e


_abandoned: set[asyncio.Future] = set()  # shutdowns of interrupted deployments


async def _deploy(client: Any, handle: ReplicatedService, blob: bytes,
                  options: ReplicaOptions, setup: tuple | None = None) -> ReplicatedService:
    if client.asynchronous:
        from dask_services.client import install_async

        await install_async(client)
    if setup is not None:  # an asynchronous client's lazy setup arguments
        args, kwargs, shipped = setup
        args, kwargs = await computed_arguments(client, args, kwargs,
                                                "the setup arguments of as_service()")
        blob = _setup_blob(handle.service_class, args, kwargs, shipped)
    scheduler = client.scheduler
    handle._uid = uuid.uuid4().hex  # made here: an interrupted deploy can be undone
    left = True  # a deployment may be left on the scheduler should this stop now
    try:
        resp = await scheduler.replicated_deploy(
            name=handle.name, blob=blob, replicas=options.replicas,
            max_concurrency=options.max_concurrency, max_queued=options.max_queued,
            workers=list(options.workers) if options.workers else None,
            resources=dict(options.resources) if options.resources else None,
            cls=handle.service_class.__name__,
            **({"procs_per_replica": options.procs_per_replica}
               if options.procs_per_replica != 1 else {}),
            **({"autoscaling": dict(options.autoscaling)} if options.autoscaling else {}),
            **({"max_replicas_per_worker": options.max_replicas_per_worker}
               if options.max_replicas_per_worker is not None else {}),
            client=client.id, uid=handle._uid,
        )
        if resp["status"] != "ok":  # nothing was deployed (the name is taken)
            left = False
            raise DeploymentError(resp["error"])
        result = await scheduler.replicated_wait(
            name=handle.name, uid=handle._uid, timeout=config_seconds("deploy-timeout"),
            deploying=True)
        if result["status"] != "ok":
            await scheduler.replicated_shutdown(name=handle.name, uid=handle._uid,
                                                timeout=0)
            left = False
            if result.get("exception"):
                raise loads_exception(result["exception"])
            if result.get("shutdown"):
                raise ServiceShutdown(result["error"])
            raise DeploymentError(f"deploying {handle.name} failed: {result['error']}")
        await handle._refresh()
    except BaseException as e:
        closed = client.status in ("closing", "closed") and isinstance(
            e, (OSError, RuntimeError, asyncio.CancelledError))
        if left:
            # interrupted (cancelled, timed out by the caller, the client closing) with
            # the deployment perhaps made: no one holds a handle, so it goes.  The uid is
            # this call's own, so nothing else is touched (a deployment never made is a
            # no-op).  Not awaited: an interruption is not delayed by the replicas'
            # stops.  (The scheduler also shuts it down should this client leave before
            # it could send this.)
            _send_shutdown(scheduler, handle.name, handle._uid)
        if closed:  # (a CommClosedError naming a connection, or the pool "closed")
            raise DeploymentError(
                f"as_service() of {handle.name} was cut short: its client closed while "
                "it waited; the deployment is shut down (the scheduler shuts down a "
                "deployment whose deploying client left)") from e
        raise
    return handle


def _send_shutdown(scheduler: Any, name: str, uid: str) -> None:
    shutdown = asyncio.ensure_future(scheduler.replicated_shutdown(name=name, uid=uid,
                                                                   timeout=0))
    _abandoned.add(shutdown)
    shutdown.add_done_callback(_abandoned.discard)
    shutdown.add_done_callback(consume)  # a shutdown that could not be sent: not logged
