"""dask-services: stateful, distributed services inside Dask task graphs.

>>> import dask_services
>>> class Sum(dask_services.Service):
...     async def add_key(self, key, data): ...

See the README for a tour, and ``design/architecture.md`` for how it works.
"""

from __future__ import annotations

import importlib

from dask_services import _auto_install, _lazy_registration
from dask_services import config as _config  # noqa: F401  (registers config defaults)
from dask_services._buffers import Buffers, IncomingBuffers
from dask_services._plugins import ExtensionError
from dask_services._spill import OutOfDiskError
from dask_services._status import status
from dask_services.client import install, install_async, service_task, story, submit
from dask_services.replicated import (
    BatchResultError,
    DeploymentError,
    EndpointRefused,
    ReplicatedService,
    ReplicaView,
    ServiceOverloaded,
    ServiceShutdown,
    ServiceUnavailable,
    endpoint,
)
from dask_services.service import (
    Concierge,
    OutputLostError,
    OutputsNotProducedError,
    PeerCallError,
    PeerHandle,
    PeerUnreachableError,
    ProduceKeyError,
    RPCRefused,
    Service,
    ServiceError,
    ServiceGraphError,
    ServiceId,
    StaleRunError,
    TooManyRestarts,
    WorkerSetupError,
    rpc,
)

_auto_install.install()  # clients sending service tasks install dask_services
# the "service" shuffle and rechunk methods: registered now if dask.dataframe or dask.array
# is imported, else as soon as it is (neither is imported for them)
_lazy_registration.install()


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    if name in ("dataframe", "array"):  # ``dask_services.array.rechunk`` without an import
        return importlib.import_module(f"dask_services.{name}")
    raise AttributeError(f"module 'dask_services' has no attribute {name!r}")

__version__ = "0.1.0"

__all__ = [
    "BatchResultError",
    "Buffers",
    "Concierge",
    "DeploymentError",
    "EndpointRefused",
    "ExtensionError",
    "IncomingBuffers",
    "OutOfDiskError",
    "OutputLostError",
    "OutputsNotProducedError",
    "PeerCallError",
    "PeerHandle",
    "PeerUnreachableError",
    "ProduceKeyError",
    "RPCRefused",
    "ReplicaView",
    "ReplicatedService",
    "Service",
    "ServiceError",
    "ServiceGraphError",
    "ServiceId",
    "ServiceOverloaded",
    "ServiceShutdown",
    "ServiceUnavailable",
    "StaleRunError",
    "TooManyRestarts",
    "WorkerSetupError",
    "endpoint",
    "install",
    "install_async",
    "rpc",
    "service_task",
    "status",
    "story",
    "submit",
]


def dask_setup(server) -> None:  # type: ignore[no-untyped-def]
    """``dask scheduler --preload dask_services`` installs the scheduler plugins (the
    service-task core and the extensions next to it, ``_plugins.py``), then those of
    other packages.  On a worker or a nanny (``dask worker --preload dask_services``, the
    ``distributed.worker.preload`` config) the import is all there is to do: the
    scheduler's plugins register the worker side."""
    from distributed import Scheduler

    from dask_services._plugins import extension_plugins, own_plugins

    if not isinstance(server, Scheduler):
        return
    scheduler = server

    own = own_plugins()
    for plugin in own:
        scheduler.add_plugin(plugin, idempotent=True)
    # Extensions of other packages after them: distributed logs a preload that raises
    # and starts the scheduler anyway, so a broken extension (its ExtensionError in the
    # scheduler's log) leaves dask-services itself installed.
    for plugin in extension_plugins(own):
        scheduler.add_plugin(plugin, idempotent=True)
