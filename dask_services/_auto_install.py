"""Installing dask-services on the cluster a graph of service tasks is sent to.

A graph with service tasks needs the scheduler plugins on the scheduler before the graph
arrives there (``update_graph`` sees every service task).  Building such a graph installs
them through the default client, when there is one (``client._maybe_install_default_client``);
but a graph is often built before its ``Client`` exists (at the top of a script), or
computed through another client than the default one (``Client(set_as_default=False)``, two
clients, ``worker_client()``).  So the client that sends a graph installs them too: every
way of computing on a cluster (``compute``, ``persist``, ``get`` and ``dask.compute``)
hands its graph to ``Client._graph_to_futures``, which ``install()`` here wraps.

A graph is searched for service tasks only once this process has made one (a
``ServiceDefinition``, a ``"service"`` shuffle's expression: ``note_service_graph``), and
only until its client is installed.  The search goes through the expression's nodes and
their operands: a node class with the attribute ``runs_service_tasks`` (the ``"service"``
shuffle, whose tasks are made on the scheduler), the tasks of the materialized layers of a
``HighLevelGraph`` (``service_task``, a rechunk with service tasks, ``dask.optimize``'s
output) and of task dicts, and the collections held by operands (``to_delayed``,
``delayed(f)(df)``, ``from_dask_array``).  A synchronous client installs before it
sends.  An asynchronous one cannot wait there (``_graph_to_futures`` is a plain method run
on its event loop), so it holds what it sends to the scheduler from that graph on
(``_send_to_scheduler``, the one way its messages leave) while ``install_async`` runs on
its loop, then sends the held messages in their order: the graph reaches the scheduler
after the plugins, and nothing sent meanwhile (releases, cancellations, other graphs)
overtakes it.  A failure to install, or to search, is left to the worker's error, which
says what to do.  ``tests/test_hooks.py`` fails loudly if an upgrade moves the methods.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from dask._expr import Expr
from dask.base import is_dask_collection
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

logger = logging.getLogger(__name__)


# Whether this process has made a service task yet (``note_service_graph``): until it
# has, no graph it sends can hold one, and clients send without looking.
_made = False


def note_service_graph() -> None:
    """A service task was made in this process (a ``ServiceDefinition``, a ``"service"``
    shuffle's expression)."""
    global _made
    _made = True


def runs_service_tasks(expr: Any) -> bool:
    """Whether the expression ``expr`` (what a client sends) holds service tasks."""
    return _holds_service_tasks(expr, set())


def _holds_service_tasks(obj: Any, seen: set[int]) -> bool:
    """Whether ``obj`` holds a service task: an expression (through every node and its
    operands), a dask collection (``to_delayed``, ``delayed(f)(df)``, ``from_dask_array``
    keep one inside an operand), a ``HighLevelGraph`` (a materialized layer with a service
    task among its tasks) or a task dict."""
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if isinstance(obj, HighLevelGraph):
        return any(_layer_holds_service_tasks(layer) for layer in obj.layers.values())
    if isinstance(obj, dict):
        return _tasks_hold_a_service_task(obj)
    if isinstance(obj, Expr):
        for node in obj.walk():
            if getattr(type(node), "runs_service_tasks", False):
                return True
            if any(_holds_service_tasks(operand, seen) for operand in node.operands
                   if isinstance(operand, (HighLevelGraph, dict)) or is_dask_collection(operand)):
                return True
        return False
    if is_dask_collection(obj):
        inner = getattr(obj, "expr", None)
        if isinstance(inner, Expr):
            return _holds_service_tasks(inner, seen)
        return _holds_service_tasks(obj.__dask_graph__(), seen)
    return False


def _layer_holds_service_tasks(layer: Any) -> bool:
    if isinstance(layer, MaterializedLayer):  # other layers make tasks of their own kinds
        return _tasks_hold_a_service_task(layer.mapping)
    return isinstance(layer, dict) and _tasks_hold_a_service_task(layer)


def _tasks_hold_a_service_task(tasks: Mapping) -> bool:
    from dask_services.graph import ServiceTaskSpec

    return any(isinstance(task, ServiceTaskSpec) for task in tasks.values())


# Asynchronous clients installing now (holding what they send), and their installs: the
# loop keeps only weak references to tasks.
_holding: weakref.WeakSet = weakref.WeakSet()
_installs: set = set()


def _installing(send: Callable) -> Callable:
    @functools.wraps(send)
    def _graph_to_futures(client: Any, expr: Any, *args: Any, **kwargs: Any) -> Any:
        from dask_services.client import _installed, install

        if _made and client not in _installed and client not in _holding:
            from dask_services._plugins import ExtensionError, extension_plugins

            try:  # every graph of the process comes here: nothing may fail its sending
                if runs_service_tasks(expr):
                    if client.asynchronous:
                        extension_plugins()  # a broken extension raises now, not later
                        _install_then_send_held(client)
                    else:
                        install(client)
            except ExtensionError:
                raise  # the user's own configuration, named: the computation fails here
            except Exception:  # noqa: BLE001 - the worker's error says what to do
                logger.debug("installing dask_services on %s failed", client, exc_info=True)
        return send(client, expr, *args, **kwargs)

    _graph_to_futures.installs_dask_services = True  # type: ignore[attr-defined]
    return _graph_to_futures


def install() -> None:
    """Make clients install dask-services when they send a graph of service tasks
    (idempotent)."""
    from distributed import Client

    current = Client._graph_to_futures
    if not getattr(current, "installs_dask_services", False):
        Client._graph_to_futures = _installing(current)


def _install_then_send_held(client: Any) -> None:
    """Hold what the asynchronous ``client`` sends to its scheduler while ``install_async``
    runs on its event loop, then send it, in order."""
    import asyncio

    from dask_services.client import install_async

    loop = asyncio.get_running_loop()  # the client's; raises (holding nothing) if none
    held: list = []
    _holding.add(client)
    client._send_to_scheduler = held.append  # shadows the method until installed

    async def install_then_send() -> None:
        try:
            await install_async(client)
        except Exception:  # noqa: BLE001 - the worker's error says what to do
            logger.debug("installing dask_services on %s failed", client, exc_info=True)
        finally:
            del client._send_to_scheduler
            _holding.discard(client)
            for message in held:
                try:
                    client._send_to_scheduler(message)
                except Exception:  # noqa: BLE001 - a client closed meanwhile
                    logger.debug("%s could not send %s", client, message.get("op"),
                                 exc_info=True)

    task = loop.create_task(install_then_send())
    _installs.add(task)
    task.add_done_callback(_installs.discard)
