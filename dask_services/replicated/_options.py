"""``@endpoint``, deployment options and ``Service.options(...)``."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from dask.utils import parse_timedelta

from dask_services.config import setting
from dask_services.replicated._routing import check_router

# What the framework sets on every replica (``_worker.py``; ``rank``, ``world_size`` and
# ``ranks`` on the ranks of a gang, ``_gang.py``).
REPLICA_ATTRIBUTES = ("id", "key", "params", "service", "peers", "rank", "world_size",
                      "ranks")


def config_seconds(name: str) -> float:
    """``dask_services.replicated.<name>`` (a duration) in seconds."""
    return float(parse_timedelta(setting(f"replicated.{name}")))

T = TypeVar("T")
_ENDPOINT_MARK = "__dask_services_endpoint__"
_BASE = "__dask_services_options_base__"
_SPEC = "__dask_services_endpoint_spec__"


_RANKS_MARK = "__dask_services_endpoint_ranks__"
RANKS = ("all", "first")


@dataclasses.dataclass(frozen=True)
class EndpointSpec:
    """How an endpoint is called: plain, batched (``batch_size``) or streaming."""

    batch_size: int | None = None  # None: not batched
    batch_wait: float = 0.0  # seconds a batch waits for more calls after its first one
    stream: bool = False  # a (sync or async) generator: called with .stream()

    @property
    def batched(self) -> bool:
        """Whether single calls are gathered into lists for the method."""
        return self.batch_size is not None


_PLAIN = EndpointSpec()


def endpoint(method: Callable[..., T] | None = None, *, batch_size: int | None = None,
             batch_wait: str | float = 0, ranks: str = "all") -> Any:
    """Mark a method of a :class:`~dask_services.Service` as callable on a deployed service.

    ``svc.method.route(...)``, ``.fanout(...)`` and ``.submit(...)`` reach only marked
    methods.  ``async def`` endpoints run on the worker's event loop; plain ``def`` ones in
    a thread of the replica (so they may block).  A generator (``def`` with ``yield``, or
    ``async def`` with ``yield``) streams: ``svc.method.stream(...)``.

    ``@endpoint(batch_size=32, batch_wait="5ms")`` batches: each call still passes one
    request (``svc.method.route(request)``), and the replica gathers the calls waiting for
    it into a list of at most ``batch_size`` requests, waiting at most ``batch_wait`` after
    the first one; the method takes that list and returns a list of as many results, in
    the same order.  An exception *instance* in a result's slot is raised at that caller
    only; an exception raised by the method, or a list of the wrong length, fails every
    call of the batch.

    ``ranks`` matters for replicas of several ranks (``options(procs_per_replica=n)``):
    ``"all"`` (the default) runs a call on every rank of the replica at once and returns
    rank 0's result; ``@endpoint(ranks="first")`` runs it on rank 0 only.
    """
    if ranks not in RANKS:
        raise ValueError(f"endpoint(ranks=...) must be one of {RANKS}, got {ranks!r}")
    if method is None:
        if batch_size is not None and (isinstance(batch_size, bool)
                                       or not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"endpoint(batch_size=...) must be an integer >= 1, got "
                             f"{batch_size!r}")
        try:
            wait = float(parse_timedelta(batch_wait, default="seconds"))
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"endpoint(batch_wait=...) must be a duration such as '5ms' or "
                             f"a number of seconds, got {batch_wait!r}") from e
        if wait < 0:
            raise ValueError(f"endpoint(batch_wait=...) must be >= 0, got {batch_wait!r}")
        if batch_size is None and batch_wait:
            raise ValueError("endpoint(batch_wait=...) needs batch_size=...")

        def mark(fn: Callable[..., T]) -> Callable[..., T]:
            marked = _mark(fn, batch_size, wait)
            setattr(marked, _RANKS_MARK, ranks)
            return marked

        return mark
    return _mark(method, None, 0.0)


def _mark(method: Callable[..., T], batch_size: int | None, wait: float) -> Callable[..., T]:
    if not callable(method):
        raise TypeError(f"@endpoint decorates methods, got {method!r}")
    stream = inspect.isgeneratorfunction(method) or inspect.isasyncgenfunction(method)
    if stream and batch_size is not None:
        raise TypeError(f"endpoint {getattr(method, '__name__', method)!r}: a generator "
                        "endpoint streams and cannot also be batched")
    setattr(method, _ENDPOINT_MARK, True)
    setattr(method, _SPEC, EndpointSpec(batch_size, wait, stream))
    return method


def endpoint_ranks(cls: type, name: str) -> str:
    """``"all"`` or ``"first"``: which ranks of a replica run endpoint ``name``."""
    return getattr(getattr(cls, name, None), _RANKS_MARK, "all")


def endpoint_spec(cls: type, name: str) -> EndpointSpec:
    """How endpoint ``name`` of ``cls`` is called (plain for an unknown name)."""
    spec = getattr(getattr(cls, name, None), _SPEC, _PLAIN)
    return spec if isinstance(spec, EndpointSpec) else _PLAIN


def is_endpoint(cls: type, name: str) -> bool:
    """Whether ``name`` is an ``@endpoint`` method of ``cls`` (looked up on the class)."""
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        return False
    attr = getattr(cls, name, None)
    return callable(attr) and getattr(attr, _ENDPOINT_MARK, False) is True


def endpoints(cls: type) -> list[str]:
    """Names of the endpoints of ``cls``, sorted."""
    return sorted(n for n in dir(cls) if is_endpoint(cls, n))


@dataclasses.dataclass(frozen=True)
class ReplicaOptions:
    """How a service is deployed; see ``Service.options``."""

    replicas: int = 1
    max_concurrency: int = 1
    max_queued: int = 100
    workers: tuple[str, ...] | None = None
    resources: Mapping[str, float] | None = None
    router: Any = "least_loaded"
    name: str | None = None
    procs_per_replica: int = 1
    autoscaling: Mapping[str, Any] | None = None
    max_replicas_per_worker: int | None = None

    def __post_init__(self) -> None:
        for field, low in (("replicas", 1), ("max_concurrency", 1), ("max_queued", 0),
                           ("procs_per_replica", 1)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                stop = ("; to stop a service call svc.shutdown()"
                        if field == "replicas" and value == 0 else "")
                raise ValueError(
                    f"options({field}=...) must be an integer >= {low}, got {value!r}{stop}"
                )
        if self.workers is not None:
            if isinstance(self.workers, (str, int)) or not isinstance(
                    self.workers, Iterable) or not all(
                    isinstance(w, (str, int)) and not isinstance(w, bool)
                    for w in self.workers):
                raise TypeError("options(workers=...) must be a list of worker addresses "
                                f"or names, e.g. [{self.workers!r}]; got {self.workers!r}")
            if not self.workers:
                raise ValueError("options(workers=[]) leaves no worker; pass None for any")
            # a worker's name may be an int (LocalCluster's 0, 1, ...): compared as str
            object.__setattr__(self, "workers", tuple(str(w) for w in self.workers))
        if self.resources is not None:
            if not isinstance(self.resources, Mapping) or not all(
                    isinstance(k, str) and isinstance(v, (int, float))
                    and not isinstance(v, bool) for k, v in self.resources.items()):
                raise TypeError("options(resources=...) must map resource names to "
                                f"amounts, e.g. {{'GPU': 1}}; got {self.resources!r}")
            if any(not v > 0 for v in self.resources.values()):
                raise ValueError("options(resources=...) amounts must be > 0, got "
                                 f"{self.resources!r}")
            object.__setattr__(self, "resources", dict(self.resources))
        check_router(self.router)
        limit = self.max_replicas_per_worker
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit < 1):
            raise ValueError("options(max_replicas_per_worker=...) must be an integer >= 1 "
                             f"or None, got {limit!r}")
        if self.autoscaling is not None:
            from dask_services.replicated._autoscale import AutoscalingConfig

            config = AutoscalingConfig.from_options(self.autoscaling)
            object.__setattr__(self, "autoscaling", config.as_dict())
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise TypeError(f"options(name=...) must be a non-empty string, got {self.name!r}")

    @classmethod
    def merged(cls, *layers: Mapping[str, Any]) -> ReplicaOptions:
        """Options from layers of keyword arguments, later ones winning."""
        known = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for layer in layers:
            unknown = set(layer) - known
            if unknown:
                raise TypeError(
                    f"unknown option(s) {sorted(unknown)}; the options are {sorted(known)}"
                )
            values.update(layer)
        return cls(**values)


def configured(cls: type, options: Mapping[str, Any]) -> type:
    """A subclass of ``cls`` whose ``service_options`` add ``options`` to its own."""
    merged = {**getattr(cls, "service_options", {}), **options}
    ReplicaOptions.merged(merged)  # validate now, not at deployment
    base = cls.__dict__.get(_BASE, cls)
    return type(cls.__name__, (cls,), {
        "service_options": merged, _BASE: base, "__module__": cls.__module__,
        "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
    })


def unconfigured(cls: type) -> type:
    """The class the user defined (what is shipped to workers), without ``options``."""
    return cls.__dict__.get(_BASE, cls)
