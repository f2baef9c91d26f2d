"""The scheduler plugins that make up dask-services on a cluster, in installation order.

The service-task core (``scheduler.ServiceSchedulerPlugin``) comes first; the extensions
are plugins of their own next to it: replicated services (``replicated/_scheduler.py``)
and the diagnostics (``_observe.py``: status tables, dashboard page, metrics), which
observe the core and so come after it.  Extensions from other packages come last: those
a distribution declares in the ``dask_services.extensions`` entry-point group (in entry
point name order), then those the ``dask_services.extensions`` config key names as
``"module:attribute"``.  ``install()``, ``install_async()`` and the ``--preload
dask_services`` hook all install this list.  Each plugin registers its own worker plugin.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from dask_services._config_check import as_imports, check_key
from dask_services.config import setting
from dask_services.service import ServiceError

ENTRY_POINT_GROUP = "dask_services.extensions"


class ExtensionError(ServiceError, ValueError):
    """An extension named by an entry point or by the ``dask_services.extensions`` config
    key could not be loaded, or is not a scheduler plugin (or the key's value is not a
    list of ``"module:attribute"``)."""


def scheduler_plugins() -> list[SchedulerPlugin]:
    """New objects of every scheduler plugin of dask-services, core first, extensions of
    other packages last.  Raises :class:`ExtensionError` naming an extension that cannot
    be loaded."""
    own = own_plugins()
    return own + extension_plugins(own)


def own_plugins() -> list[SchedulerPlugin]:
    """New objects of dask-services' own scheduler plugins, core first."""
    from dask_services._observe import ServiceDiagnostics
    from dask_services.replicated._scheduler import Deployments
    from dask_services.scheduler import ServiceSchedulerPlugin

    return [ServiceSchedulerPlugin(), Deployments(), ServiceDiagnostics()]


def extension_plugins(own: list[SchedulerPlugin] | None = None) -> list[SchedulerPlugin]:
    """New objects of the scheduler plugins of other packages' extensions (entry points,
    then the config key's), checked against each other and ``own``."""
    plugins: list[SchedulerPlugin] = []
    seen = {plugin.name: "dask-services itself" for plugin in own or own_plugins()}
    for origin, load in _declared_extensions():
        plugin = _as_plugin(origin, load)
        name = plugin.name
        if name in seen:
            raise ExtensionError(
                f"extension {origin} makes a scheduler plugin named {name!r}, as "
                f"{seen[name]} does: the second would replace the first on the scheduler; "
                "give the plugin a `name` of its own")
        seen[name] = origin
        plugins.append(plugin)
    return plugins


def _declared_extensions() -> list[tuple[str, Any]]:
    """(where it was declared, a callable loading it) for each extension of another
    package: entry points first, in name order, then the config key's entries."""
    found: list[tuple[str, Any]] = []
    points = sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP),
                    key=lambda ep: ep.name)
    for ep in points:
        dist = getattr(ep.dist, "name", None) or "an installed distribution"
        found.append((f"entry point {ep.name!r} = {ep.value!r} of {dist} (group "
                      f"{ENTRY_POINT_GROUP!r}; fix or uninstall that package)", ep.load))
    try:
        check_key("extensions")
    except ValueError as e:
        raise ExtensionError(str(e)) from None
    for spec in as_imports(setting("extensions")):
        found.append((f"{spec!r} in the dask_services.extensions config key",
                      lambda spec=spec: _import(spec)))
    return found


def _import(spec: str) -> Any:
    """What ``"module:attribute"`` names, loaded as an entry point of that value is."""
    return importlib.metadata.EntryPoint(name=spec, value=spec,
                                         group=ENTRY_POINT_GROUP).load()


def _as_plugin(origin: str, load: Any) -> SchedulerPlugin:
    """The scheduler plugin an extension stands for: a ``SchedulerPlugin`` object, a
    subclass of it (made with no arguments), or a callable returning one."""
    try:
        target = load()
    except Exception as e:
        raise ExtensionError(
            f"extension {origin} could not be loaded: {type(e).__name__}: {e}") from e
    try:
        if isinstance(target, SchedulerPlugin):
            plugin = target
        elif callable(target):
            plugin = target()
        else:
            plugin = None
    except Exception as e:
        raise ExtensionError(
            f"extension {origin} failed to make its scheduler plugin: "
            f"{type(e).__name__}: {e}") from e
    if not isinstance(plugin, SchedulerPlugin):
        raise ExtensionError(
            f"extension {origin} gave {type(plugin if plugin is not None else target)!r}"
            ", not a distributed SchedulerPlugin: point it at a SchedulerPlugin subclass, "
            "an instance of one, or a function returning one")
    # Installed once per cluster, however many clients install: distributed names a
    # plugin without a name anew each time, and starts one that is not idempotent again
    # (its first never closed), so an extension is named after its class if need be and
    # always installed idempotently.
    try:
        if not getattr(plugin, "name", None):
            plugin.name = f"{type(plugin).__module__}.{type(plugin).__qualname__}"
        plugin.idempotent = True
    except AttributeError as e:  # __slots__ without them
        raise ExtensionError(
            f"extension {origin}: its scheduler plugin's `name` and `idempotent` cannot "
            f"be set ({e}); give its class `name = ...` and `idempotent = True`") from e
    return plugin
