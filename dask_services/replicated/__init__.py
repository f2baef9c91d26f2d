"""Replicated services: a ``Service`` deployed as N long-lived replicas on workers.

>>> class Model(dask_services.Service):
...     async def setup(self, path): ...
...     @dask_services.endpoint
...     async def predict(self, batch): ...
>>> svc = Model.options(replicas=3).as_service(path="...")   # doctest: +SKIP
>>> svc.predict.route(batch).result()                          # doctest: +SKIP

Modules, one job each: ``_lifecycle`` (the replica state machine, pure), ``_routing``
(routers), ``_queue`` (per-replica admission), ``_metrics``, ``_options`` (``@endpoint``,
options), ``_handle`` (the caller's side), ``_deploy`` (``as_service``), ``_scheduler`` and
``_worker`` (the two sides on the cluster).  How it works: ``design/replicated-services.md``.
"""

from __future__ import annotations

from dask_services.replicated import _table  # noqa: F401  (registers the "replicas" table)
from dask_services.replicated._endpoints import Call, Endpoint, Session
from dask_services.replicated._errors import (
    BatchResultError,
    DeploymentError,
    EndpointRefused,
    ServiceOverloaded,
    ServiceShutdown,
    ServiceUnavailable,
)
from dask_services.replicated._handle import ReplicatedService
from dask_services.replicated._lifecycle import ReplicaState
from dask_services.replicated._options import ReplicaOptions, endpoint, is_endpoint
from dask_services.replicated._routing import (
    LeastLoaded,
    PowerOfTwo,
    ReplicaView,
    RoundRobin,
    Router,
    SessionAffinity,
)
from dask_services.replicated._streaming import Stream

__all__ = [
    "BatchResultError",
    "Call",
    "DeploymentError",
    "Endpoint",
    "EndpointRefused",
    "LeastLoaded",
    "PowerOfTwo",
    "ReplicaOptions",
    "ReplicaState",
    "ReplicaView",
    "ReplicatedService",
    "RoundRobin",
    "Router",
    "ServiceOverloaded",
    "ServiceShutdown",
    "ServiceUnavailable",
    "Session",
    "SessionAffinity",
    "Stream",
    "endpoint",
    "is_endpoint",
]
