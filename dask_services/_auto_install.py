"""Installing dask-services on the cluster a graph of service tasks is sent to.

A graph with service tasks needs the scheduler plugins on the scheduler before the graph
arrives there (``update_graph`` sees every service task).  Building such a graph installs
them through the default client, when there is one (``client._maybe_install_default_client``);
but a graph is often built before its ``Client`` exists (at the top of a script), or
computed through another client than the default one (``Client(set_as_default=False)``, two
clients, ``worker_client()``).  So the client that sends a graph installs them too: every
way of computing on a cluster (``compute``, ``persist``, ``get`` and ``dask.compute``)
hands its graph to ``Client._graph_to_futures``, which ``install()`` here wraps.

Graphs are recognized without looking at their tasks: a service task of a ``HighLevelGraph``
sits in a :class:`ServiceLayer` (made by ``service_task`` and the rechunk), and a dataframe
expression whose lowering makes service tasks says so with a class attribute
``runs_service_tasks`` (the ``"service"`` shuffle).  Only a synchronous client installs
(an asynchronous one cannot wait for the plugins while it sends the graph: ``await
install_async(client)``); a failure to install is left to the worker's error, which says
what to do.  ``tests/test_hooks.py`` fails loudly if an upgrade moves the method.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

logger = logging.getLogger(__name__)


class ServiceLayer(MaterializedLayer):
    """A layer of a ``HighLevelGraph`` with service tasks among its tasks."""


def layer_of(tasks: Mapping) -> MaterializedLayer | Mapping:
    """``tasks`` as a :class:`ServiceLayer` if a service task is among them."""
    from dask_services.graph import ServiceTaskSpec

    if any(isinstance(task, ServiceTaskSpec) for task in tasks.values()):
        return ServiceLayer(tasks)
    return tasks


def runs_service_tasks(expr: Any) -> bool:
    """Whether the expression ``expr`` (what a client sends) holds service tasks."""
    walk = getattr(expr, "walk", None)
    if walk is None:
        return False
    for node in walk():
        if getattr(type(node), "runs_service_tasks", False):
            return True
        operands = getattr(node, "operands", None)
        graph = operands[0] if operands else None
        if isinstance(graph, HighLevelGraph) and any(
                isinstance(layer, ServiceLayer) for layer in graph.layers.values()):
            return True
    return False


def _installing(send: Callable) -> Callable:
    @functools.wraps(send)
    def _graph_to_futures(client: Any, expr: Any, *args: Any, **kwargs: Any) -> Any:
        from dask_services.client import _installed, install

        if client not in _installed and not client.asynchronous:
            try:  # every graph of the process comes here: nothing may fail its sending
                if runs_service_tasks(expr):
                    install(client)
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
