"""``Service.options()`` / ``Service.as_service()``: the replicated-services API on every
service class, kept out of the core.

``service.Service`` inherits :class:`Deployable`; the replicated package is imported only
when one of these classmethods is called, so the service-task core never imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

S = TypeVar("S")


class Deployable:
    """Deploying a service class as N long-lived replicas (``replicated/``)."""

    # Class-level deployment defaults, e.g. ``service_options = {"replicas": 2}``;
    # ``options(...)`` overrides them.
    service_options: Mapping[str, Any] = {}

    @classmethod
    def options(cls: type[S], **options: Any) -> type[S]:
        """A copy of this class configured for deployment; chainable.

        Options: ``replicas``, ``max_concurrency``, ``max_queued``, ``workers``,
        ``resources``, ``router``, ``name`` (see the README, "Replicated services").
        """
        from dask_services.replicated._options import configured

        return configured(cls, options)

    @classmethod
    def as_service(cls, *args: Any, client: Any = None, **kwargs: Any) -> Any:
        """Deploy the class as replicas on workers and return its handle once every
        replica is healthy (or raise the error of ``setup``, which gets ``args`` and
        ``kwargs``).  With an asynchronous client, await the result."""
        from dask_services.replicated._deploy import as_service

        return as_service(cls, args, kwargs, client)
