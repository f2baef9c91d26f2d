"""Errors of replicated services."""

from __future__ import annotations

from dask_services.service import RPCRefused, ServiceError


class ServiceOverloaded(ServiceError):
    """A replica already runs ``max_concurrency`` calls and has ``max_queued`` waiting."""


class ServiceShutdown(ServiceError):
    """The service (or the replica) is shutting down: the call was not started."""


class ServiceUnavailable(ServiceError):
    """No healthy replica answered within the retries (see the message for why)."""


class EndpointRefused(RPCRefused, AttributeError):
    """A call asked for a method that is not marked with ``@dask_services.endpoint``."""


class DeploymentError(ServiceError):
    """A replicated service could not be deployed (see the message and the cause)."""


class ReplicaGone(ServiceError):
    """The addressed replica does not exist (any more) on that worker; internal, retried."""


def gone_answer(e: ReplicaGone) -> dict:
    """The answer to a call a lost replica (or rank) ended: re-sent by the caller.
    ``lost_in_flight`` when a rank of a gang was lost while it had the call (its worker
    died, perhaps of the call), which the caller counts against
    ``distributed.scheduler.allowed-failures`` as it counts a replica lost so."""
    return {"status": "gone", "message": str(e),
            "lost_in_flight": bool(getattr(e, "in_flight", False))}


class ScaledDown(ReplicaGone):
    """The replica is being scaled down: calls it has not started are sent elsewhere, a
    call still running when its drain ends is not (it started, and may have had effects);
    internal."""


class CallMoved(ServiceError):
    """A queued call that its replica gave back, not started, so that a replica with less
    to do takes it (replicas were added while it waited); internal, sent again at once.
    ``replicas``: the healthy replicas as the scheduler saw them when it asked, ``[id,
    worker, load once the calls given back are sent on]`` (the caller's routing).
    ``caller_left``: given back because its caller left the cluster (a caller still there
    sends it again, not counted as a call moved by a rebalancing pass)."""

    def __init__(self, message: str, replicas: list | None = None,
                 caller_left: bool = False) -> None:
        super().__init__(message)
        self.replicas = replicas or []
        self.caller_left = caller_left


class BatchResultError(ServiceError, ValueError):
    """A batched endpoint returned something other than one result per request (raised
    at every caller of that batch)."""
