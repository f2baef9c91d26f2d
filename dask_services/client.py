"""Submitting service tasks: ``submit`` (futures), ``service_task`` (lazy), ``install``."""

from __future__ import annotations

import inspect
import numbers
import weakref
from collections.abc import Sequence
from typing import Any

import dask
from dask.base import is_dask_collection, replace_name_in_key, tokenize
from dask.core import flatten, validate_key
from dask.delayed import Delayed
from dask.highlevelgraph import HighLevelGraph
from dask.typing import Key
from dask.utils import ensure_dict, funcname

from dask_services._config_check import check_config
from dask_services._lazy_arguments import lazy_arguments
from dask_services.graph import ServiceDefinition, build_service_graph
from dask_services.service import (
    INSTANCE_ATTRIBUTES,
    START_ARGUMENTS,
    Service,
    ServiceGraphError,
    check_instance_attributes,
)

_installed: weakref.WeakSet = weakref.WeakSet()


def install(client: Any = None) -> None:
    """Install the scheduler plugins (the service-task core, replicated services and the
    diagnostics; see ``_plugins.py``), and through them the worker plugins, on a cluster.

    Harmless to call more than once.  Deployments may instead start the scheduler with
    ``dask scheduler --preload dask_services``.
    """
    from distributed import default_client

    from dask_services._plugins import scheduler_plugins

    client = client or default_client()
    if client in _installed:
        return
    if client.asynchronous:
        raise TypeError(
            "install() needs a synchronous Client; in async code use "
            "`await dask_services.install_async(client)`"
        )
    for plugin in scheduler_plugins():
        client.register_plugin(plugin)
    _installed.add(client)


async def install_async(client: Any) -> None:
    """``install`` for an asynchronous ``Client``."""
    from dask_services._plugins import scheduler_plugins

    if client in _installed:
        return
    # a client made and used without being awaited first (``cluster.get_client()`` in
    # async code, ``Client(address, asynchronous=True)``) is still connecting: its graph
    # waits in its buffer, a plugin's registration needs the connection
    await client
    for plugin in scheduler_plugins():
        await client.register_plugin(plugin)
    _installed.add(client)


def _check_service_class(service_class: Any) -> None:
    if not (isinstance(service_class, type) and issubclass(service_class, Service)):
        raise TypeError(
            f"expected a subclass of dask_services.Service, got {service_class!r}; "
            "define `class MyService(dask_services.Service): ...` and pass the class"
        )
    check_instance_attributes(service_class, INSTANCE_ATTRIBUTES,
                              "every instance of a service task")


def _output_names(outputs: int | Sequence[Key], name: str, token: str) -> tuple[Key, ...]:
    if isinstance(outputs, bool) or outputs is None:
        raise TypeError("outputs must be a number of outputs or a list of output keys")
    if isinstance(outputs, numbers.Integral):
        if outputs < 0:
            raise ValueError(f"outputs must be >= 0, got {outputs}")
        return tuple((f"{name}-output-{token}", i) for i in range(int(outputs)))
    if isinstance(outputs, (str, bytes)):
        raise TypeError(
            f"outputs={outputs!r} is a string, which would make one output per character: "
            f"pass the number of outputs, or a list of output keys (outputs=[{outputs!r}])")
    try:
        names = tuple(outputs)
    except TypeError:
        raise TypeError("outputs must be a number of outputs or a list of output keys, got "
                        f"a {type(outputs).__name__}") from None
    for k in names:
        try:  # dask's own rule: str, int, float, or a tuple of those (nested)
            validate_key(k)
        except TypeError as e:
            raise TypeError(f"output key {k!r} is not a valid dask key ({e}): give str, "
                            "int or float keys, or tuples of them") from None
    if len(set(names)) != len(names):
        twice = sorted({str(k) for k in names if names.count(k) > 1})
        raise ServiceGraphError(f"output keys given twice to service_task(): {twice[:5]}; "
                                "each output key must be unique")
    return names


def _check_options_given(service_class: type[Service], given: Sequence[str],
                         function: str) -> None:
    """Refuse options of ``function`` in ``given`` (those given, not left at their
    defaults) that ``start()`` names as parameters: given there, they are ``function``'s
    and would never reach ``start()``, which would silently take its default."""
    try:
        declared = inspect.signature(service_class.start).parameters
    except (TypeError, ValueError):  # pragma: no cover - a builtin or odd callable
        return
    taken = [p for p in given if p in declared
             and declared[p].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                      inspect.Parameter.KEYWORD_ONLY)]
    if taken:
        raise TypeError(
            f"{', '.join(f'{p}=' for p in taken)} given to {function}() is its own "
            f"option, but {service_class.__name__}.start() has a parameter of that name, "
            "which would never receive it; rename the parameter of start() (and pass "
            "the value under the new name)")


def _definition(service_class: type[Service], input_keys: Sequence[Key],
                outputs: int | Sequence[Key], params: dict, placement: str | None,
                name: str | None, participants: str = "all"
                ) -> tuple[Key, ServiceDefinition]:
    clashes = sorted(set(params) & set(START_ARGUMENTS))
    if clashes:
        raise TypeError(
            f"parameter(s) {clashes} of {service_class.__name__} clash with the arguments "
            f"every start() receives ({', '.join(START_ARGUMENTS)}); rename them")
    lazy = lazy_arguments((), params)
    if lazy:
        raise TypeError(
            f"parameter(s) {', '.join(lazy)} of {service_class.__name__}: parameters reach "
            "every instance's start() as they are given, nothing computes them; pass the "
            "value among the inputs (it reaches add_key() on a worker that holds it), or "
            "compute it first (future.result(), dask.compute(...))")
    if placement is not None and not isinstance(placement, str):
        raise TypeError(
            f"placement={placement!r} is a {type(placement).__name__}: give the name the "
            "service tasks that are to agree on where their outputs go share, a string "
            "(placement='my-group')")
    name = name or funcname(service_class).lower()
    token = tokenize(service_class, params, tuple(input_keys), outputs, placement,
                     participants)
    output_keys = _output_names(outputs, name, token)
    service_key = f"service-{name}-{token}"
    handoffs = tuple((f"handoff-{name}-{token}", j) for j in range(len(input_keys)))
    definition = ServiceDefinition(
        service_class=service_class, params=dict(params), input_keys=tuple(input_keys),
        handoff_keys=handoffs, output_keys=output_keys, placement=placement, name=name,
        participants=participants,
    )
    return service_key, definition


class ServiceOutput(Delayed):
    """One output of a service task: a ``Delayed`` whose graph layer is its service
    task's.  Rebuilt (``dask.graph_manipulation``'s ``wait_on``), dask's own ``Delayed``
    looks for a layer named like its key, which has none.  ``clone`` and ``bind`` (with
    outputs as children) rename the service task's keys but not the ones its tasks name
    inside them: refused here, as the graph is built, rather than failing on the cluster."""

    __slots__ = ()

    def _rebuild(self, dsk: Any, *, rename: Any = None) -> Delayed:
        key = replace_name_in_key(self.key, rename) if rename else self.key
        if not isinstance(dsk, HighLevelGraph):
            return Delayed(key, dsk, self._length)
        if rename and self._layer not in dsk.layers:
            raise ServiceGraphError(
                f"the graph of service task output {self.key!r} was rebuilt with its "
                "service task's keys renamed (dask.graph_manipulation's clone(), or bind() "
                "with service task outputs as children): its tasks still name the original "
                "keys inside them; call service_task() again for a second copy, or "
                "wait_on() / bind() with the outputs as parents to order it")
        for name in (self._layer, key, key[0] if isinstance(key, tuple) and key else None):
            if name is not None and name in dsk.layers:
                return Delayed(key, dsk, self._length, layer=name)
        if len(dsk.layers) == 1:
            return Delayed(key, dsk, self._length, layer=next(iter(dsk.layers)))
        return Delayed(key, ensure_dict(dsk), self._length)


def service_task(service_class: type[Service], inputs: Sequence[Any] | Any, *,
                 outputs: int | Sequence[Key], placement: str | None = None,
                 name: str | None = None, participants: str = "all",
                 **params: Any) -> list[Delayed]:
    """A lazy service task: one ``Delayed`` per output key.

    ``inputs`` is a list of ``Delayed`` objects and dask collections (every key of a
    collection, e.g. every partition of a DataFrame, is one input), or one collection.
    ``outputs`` is the number of outputs or a list of output keys.  ``params`` reach every
    instance as keyword arguments of ``start`` and as ``self.params``.  Service tasks with
    the same ``placement`` string agree on which worker produces output *i*.
    ``participants``: ``"all"`` (an instance on every worker), ``"input-holders"`` (only
    on the workers that hold or compute an input, every worker while one has no place
    yet; outputs are then produced on those workers only) or ``"involved"`` (on the
    workers that hold or compute an input and those that own an output, outputs placed as
    for ``"all"`` but on the input holders first; every worker while an input has no
    place yet).

    The result composes with the rest of dask: compute it with a ``Client`` (the instances
    then live on the workers) or with a local scheduler (the instances run in-process).
    """
    check_config()
    _check_service_class(service_class)
    given = {"outputs": True, "placement": placement is not None, "name": name is not None,
             "participants": participants != "all"}
    _check_options_given(service_class, [o for o, g in given.items() if g], "service_task")
    if is_dask_collection(inputs):
        inputs = [inputs]
    inputs = list(inputs)
    input_keys: list[Key] = []
    for obj in inputs:
        if not is_dask_collection(obj):
            if type(obj).__name__ == "Future" and hasattr(obj, "key"):
                raise TypeError(
                    "service_task() inputs must be dask collections or Delayed objects, got "
                    "a Future; to run a service on futures use dask_services.submit("
                    "service_class, futures, outputs=...), which returns futures"
                )
            raise TypeError(
                f"service_task() inputs must be dask collections or Delayed objects, got "
                f"{type(obj).__name__}; wrap plain values with dask.delayed(value)"
            )
        input_keys.extend(flatten(obj.__dask_keys__()))
    seen: set = set()
    for key in input_keys:
        if key in seen:
            raise ServiceGraphError(
                f"the input key {key!r} was given twice to service_task(); give each "
                "input once (client.submit is pure by default: the same function and "
                "arguments make the same key, pass pure=False for distinct ones)")
        seen.add(key)
    service_key, definition = _definition(
        service_class, input_keys, outputs, params, placement, name, participants
    )
    layer = build_service_graph(definition, service_key, input_keys)
    graph = HighLevelGraph.from_collections(service_key, layer, dependencies=inputs)
    _maybe_install_default_client()
    return [ServiceOutput(k, graph, layer=service_key) for k in definition.output_keys]


def submit(service_class: type[Service], inputs: Sequence[Any], *,
           outputs: int | Sequence[Key], client: Any = None, placement: str | None = None,
           name: str | None = None, participants: str = "all",
           retries: int | None = None, priority: int = 0, workers: Any = None,
           resources: dict | None = None, allow_other_workers: bool = False,
           **params: Any) -> list[Any]:
    """Run a service task on a cluster now; returns one ``Future`` per output key.

    ``inputs`` is a list of futures (or dask collections / ``Delayed`` objects), or one
    future or collection.  ``retries``, ``priority``, ``workers``, ``resources`` and
    ``allow_other_workers`` are task options, as for ``Client.submit`` (annotations of the
    service task's graph, as ``dask.annotate`` gives them); every other keyword is a
    parameter of the service's ``start``.
    """
    from distributed import Future, default_client

    _check_service_class(service_class)
    given = {"outputs": True, "client": client is not None, "placement": placement is not None,
             "name": name is not None, "participants": participants != "all",
             "retries": retries is not None, "priority": bool(priority),
             "workers": workers is not None, "resources": resources is not None,
             "allow_other_workers": bool(allow_other_workers)}
    _check_options_given(service_class, [o for o, g in given.items() if g], "submit")
    if isinstance(inputs, Future):
        inputs = [inputs]
    client = client or default_client()
    if not client.asynchronous:  # an asynchronous one installs as it sends the graph
        install(client)
    collections = []
    for obj in inputs:
        if isinstance(obj, Future):
            collections.append(Delayed(obj.key, {obj.key: obj}))
        else:
            collections.append(obj)
    # as annotations of the service task's graph, as with ``dask.annotate`` around
    # ``service_task``: a service task restricted to workers runs its instances there
    options = {"retries": retries, "priority": priority or None, "workers": workers,
               "resources": resources, "allow_other_workers": allow_other_workers or None}
    with dask.annotate(**{k: v for k, v in options.items() if v is not None}):
        outs = service_task(service_class, collections, outputs=outputs,
                            placement=placement, name=name, participants=participants,
                            **params)
    if not outs:
        return []
    return client.compute(outs)


def _maybe_install_default_client() -> None:
    try:
        from distributed import default_client

        client = default_client()
    except (ImportError, ValueError):
        return
    if client.asynchronous or client in _installed:
        return
    from dask_services._plugins import ExtensionError

    try:
        install(client)
    except ExtensionError:
        raise  # the user's own configuration, named: fail where the graph is built
    except Exception:  # pragma: no cover - best effort; the worker raises a clear error
        pass


def story(client: Any = None, key_or_run: Any = None) -> Any:
    """What happened to a service task, or to one of its runs: the scheduler's story.

    ``key_or_run`` is a service task's key (or one of its outputs: a key, a ``Future`` or
    a ``Delayed``), or a run id (an ``int``, as in ``dask_services.status()``).  Returns
    a list of entries in the order they happened, each a dict: ``time``, ``key``,
    ``run_id``, ``stimulus_id`` (what caused it: a scheduler transition, a worker message,
    a worker leaving...), ``kind`` (``"received"``: an event reached the run's state
    machine; ``"decided"``: the machine changed state, e.g. ``run 3: running ->
    inputs-done``; ``"sent"``: an action it took, e.g. ``StartInstances``, ``Log``),
    ``what`` and ``detail``.  The scheduler keeps ``dask_services.story.entries`` entries
    per run (the run's per-key routine apart from its milestones), for
    ``dask_services.story.runs`` runs per service task and as many service tasks once
    they are forgotten.  With an asynchronous client, await the result.
    """
    from distributed import default_client

    client = client or default_client()
    if not client.asynchronous:
        install(client)
    first = client.asynchronous  # awaited, it installs first (as install() does above)
    if isinstance(key_or_run, numbers.Integral) and not isinstance(key_or_run, bool):
        # (a numpy integer too: the run ids of ``status()``'s table are)
        return client.sync(_story, client, first, run_id=int(key_or_run))
    return client.sync(_story, client, first, key=getattr(key_or_run, "key", key_or_run))


async def _story(client: Any, install_first: bool, **query: Any) -> list[dict[str, Any]]:
    if install_first:
        await install_async(client)
    return [dict(entry) for entry in await client.scheduler.service_story(**query)]
