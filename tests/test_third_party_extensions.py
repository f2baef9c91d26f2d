"""Extensions of other packages plug into the core without editing dask-services: an
entry point of the ``dask_services.extensions`` group, or the ``dask_services.extensions``
config key, names a scheduler plugin that ``install()`` and ``--preload dask_services``
install after dask-services' own."""

from __future__ import annotations

import logging
import sys

import dask
import pytest
from distributed import Client
from distributed.utils_test import captured_logger, gen_cluster

import dask_services
from dask_services import ExtensionError
from dask_services._plugins import scheduler_plugins
from dask_services.client import _installed
from dask_services.examples import AllReduce

pytestmark = pytest.mark.timeout(60)

# A package of its own: a scheduler plugin that watches the core's runs (a RunObserver)
# and registers a worker plugin, as the built-in extensions do.
EXTENSION_MODULE = '''
from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin
from distributed.protocol.pickle import dumps

from dask_services.scheduler import RunObserver


class RunWatcherWorker(WorkerPlugin):
    name = "run_watcher"

    def setup(self, worker):
        worker.extensions["run_watcher"] = self


class Watcher(RunObserver):
    def __init__(self):
        self.actions = []

    def run_logged(self, entry):
        self.actions.append((entry.service, entry.action))


class RunWatcher(SchedulerPlugin):
    name = "run_watcher"

    async def start(self, scheduler):
        self.watcher = Watcher()
        scheduler.extensions["run_watcher"] = self
        scheduler.extensions["dask_services"].observers.append(self.watcher)
        await scheduler.register_worker_plugin(
            None, dumps(RunWatcherWorker()), name="run_watcher", idempotent=True)


class Unrelated:
    pass


def make_watcher():
    return RunWatcher()


class Clashing(SchedulerPlugin):
    name = "dask_services"


class Unnamed(SchedulerPlugin):
    pass


class AlsoUnnamed(SchedulerPlugin):
    pass


def failing():
    raise RuntimeError("no licence server")
'''


@pytest.fixture
def extension_module(tmp_path, monkeypatch):
    """The module above, importable as ``run_watcher_ext``; forgotten afterwards."""
    (tmp_path / "run_watcher_ext.py").write_text(EXTENSION_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("run_watcher_ext", None)


def declare_entry_points(path, **points: str) -> None:
    """An installed distribution (its ``.dist-info``) declaring ``points`` in the
    ``dask_services.extensions`` group."""
    info = path / "run_watcher_ext-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: run-watcher-ext\nVersion: 1.0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in points.items())
    (info / "entry_points.txt").write_text(f"[dask_services.extensions]\n{lines}")


def names(plugins) -> list[str]:
    return [p.name for p in plugins]


BUILT_IN = ["dask_services", "dask_services_replicated", "dask_services_diagnostics"]


def test_no_extension_declared_gives_the_built_in_plugins():
    assert names(scheduler_plugins()) == BUILT_IN


def test_an_entry_point_adds_its_plugin_after_the_built_in_ones(extension_module):
    declare_entry_points(extension_module, watcher="run_watcher_ext:RunWatcher")
    assert names(scheduler_plugins()) == [*BUILT_IN, "run_watcher"]


def test_the_config_key_may_be_one_string_as_an_environment_variable_gives_it(
        extension_module):
    with dask.config.set({"dask_services.extensions":
                          "run_watcher_ext:RunWatcher, run_watcher_ext:Unnamed"}):
        assert names(scheduler_plugins()) == [*BUILT_IN, "run_watcher",
                                              "run_watcher_ext.Unnamed"]


def test_extensions_are_named_after_their_class_and_installed_idempotently(
        extension_module):
    with dask.config.set({"dask_services.extensions": [
            "run_watcher_ext:Unnamed", "run_watcher_ext:AlsoUnnamed"]}):
        plugins = scheduler_plugins()[len(BUILT_IN):]
    assert names(plugins) == ["run_watcher_ext.Unnamed", "run_watcher_ext.AlsoUnnamed"]
    assert all(p.idempotent for p in plugins)


@pytest.mark.parametrize("spec", ["run_watcher_ext:RunWatcher",
                                  "run_watcher_ext:make_watcher"])
def test_the_config_key_adds_a_plugin_class_or_factory(extension_module, spec):
    with dask.config.set({"dask_services.extensions": [spec]}):
        plugins = scheduler_plugins()
    assert names(plugins) == [*BUILT_IN, "run_watcher"]
    assert type(plugins[-1]).__name__ == "RunWatcher"


def test_an_installed_extension_watches_runs_and_reaches_the_workers(extension_module):
    declare_entry_points(extension_module, watcher="run_watcher_ext:RunWatcher")

    @gen_cluster(client=True, nthreads=[("", 1)] * 2)
    async def run(c, s, a, b):
        try:
            await dask_services.install_async(c)
            assert "run_watcher" in s.extensions
            assert all("run_watcher" in w.extensions for w in (a, b))
            futures = dask_services.submit(AllReduce, c.map(abs, range(10)), outputs=2,
                                           client=c)
            assert await c.gather(futures) == [45, 45]
            actions = s.extensions["run_watcher"].watcher.actions
            assert ("AllReduce", "started") in actions, actions
            assert ("AllReduce", "finished") in actions, actions
            # every client installs; the extension starts once
            async with Client(s.address, asynchronous=True) as other:
                await dask_services.install_async(other)
            watchers = [o for o in s.extensions["dask_services"].observers
                        if type(o).__name__ == "Watcher"]
            assert watchers == [s.extensions["run_watcher"].watcher]
            s.validate_state()
        finally:
            _installed.discard(c)

    run()


@pytest.mark.parametrize("spec, message", [
    ("no_such_package_here:Plugin",
     r"'no_such_package_here:Plugin' in the dask_services.extensions config key could "
     r"not be loaded: ModuleNotFoundError"),
    ("run_watcher_ext:Missing", r"could not be loaded: AttributeError"),
    ("run_watcher_ext:Unrelated", r"gave <class 'run_watcher_ext.Unrelated'>, not a "
                                  r"distributed SchedulerPlugin"),
    ("run_watcher_ext:failing", r"failed to make its scheduler plugin: RuntimeError: no "
                                r"licence server"),
    ("run_watcher_ext:Clashing", r"named 'dask_services', as dask-services itself does"),
])
def test_a_bad_extension_is_named_with_what_is_wrong(extension_module, spec, message):
    with dask.config.set({"dask_services.extensions": [spec]}):
        with pytest.raises(ExtensionError, match=message):
            scheduler_plugins()


def test_a_bad_entry_point_names_its_distribution(extension_module):
    declare_entry_points(extension_module, broken="run_watcher_ext:Missing")
    with pytest.raises(ExtensionError, match=r"entry point 'broken' = "
                       r"'run_watcher_ext:Missing' of run-watcher-ext .*fix or uninstall"):
        scheduler_plugins()


def test_two_extensions_of_one_name_are_refused(extension_module):
    declare_entry_points(extension_module, watcher="run_watcher_ext:RunWatcher")
    with dask.config.set({"dask_services.extensions": ["run_watcher_ext:make_watcher"]}):
        with pytest.raises(ExtensionError, match=r"named 'run_watcher', as entry point "
                                                 r"'watcher'"):
            scheduler_plugins()


@pytest.mark.parametrize("value", ["run_watcher_ext", "a:b, no_colon", ["no_colon"], [3],
                                   [":Plugin"], None])
def test_a_config_value_not_a_list_of_imports_is_refused(value):
    with dask.config.set({"dask_services.extensions": value}):
        with pytest.raises(ValueError, match=r"dask_services.extensions=.* is not valid: "
                                             r"it should be a list of \"module:attribute\""):
            scheduler_plugins()


def test_the_preload_hook_installs_the_extensions(extension_module):
    declare_entry_points(extension_module, watcher="run_watcher_ext:RunWatcher")

    @gen_cluster(client=True, scheduler_kwargs={"preload": ["dask_services"]})
    async def run(c, s, a, b):
        assert [name for name in s.plugins if not name.startswith("distributed")][-1:] \
            == ["run_watcher"]
        assert "run_watcher" in s.extensions
        assert all("run_watcher" in w.extensions for w in (a, b))

    run()



def test_a_broken_extension_fails_the_automatic_install_with_its_name():
    from distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        with dask.config.set({"dask_services.extensions": ["no_such_package_here:Plugin"]}):
            # where the graph is built (the default client installs then)
            with pytest.raises(ExtensionError, match="no_such_package_here:Plugin"):
                dask_services.service_task(AllReduce, [dask.delayed(1)], outputs=1)
        with dask.config.set({"dask_services.extensions": []}):
            outputs = dask_services.service_task(AllReduce, [dask.delayed(1)], outputs=1)
        _installed.discard(client)  # built without installing: compute() installs
        with dask.config.set({"dask_services.extensions": ["no_such_package_here:Plugin"]}):
            with pytest.raises(ExtensionError, match="no_such_package_here:Plugin"):
                client.compute(outputs[0]).result()


def test_a_broken_extension_fails_an_asynchronous_clients_computation_early():
    @gen_cluster(client=True)
    async def run(c, s, a, b):
        outputs = dask_services.service_task(AllReduce, [dask.delayed(1)], outputs=1)
        with dask.config.set({"dask_services.extensions": ["no_such_package_here:Plugin"]}):
            with pytest.raises(ExtensionError, match="no_such_package_here:Plugin"):
                c.compute(outputs[0])
        _installed.discard(c)

    run()


def test_the_preload_hook_installs_dask_services_despite_a_broken_extension():
    @gen_cluster(client=True, scheduler_kwargs={"preload": ["dask_services"]},
                 config={"dask_services.extensions": ["no_such_package_here:Plugin"]})
    async def run(c, s, a, b):
        # distributed logs the preload's ExtensionError and starts the scheduler anyway
        assert {"dask_services", "dask_services_replicated",
                "dask_services_diagnostics"} <= set(s.extensions)

    with captured_logger("distributed.preloading", level=logging.ERROR) as log:
        run()
    assert "ExtensionError" in log.getvalue()
    assert "no_such_package_here:Plugin" in log.getvalue()
