"""What a newcomer reads: the command line's help, the demo's hints and output, the logs of
a cluster closing with a deployed service, and the exceptions the package exports."""

from __future__ import annotations

import logging
import shlex
import sys
import tomllib
from pathlib import Path

import dask
import pandas as pd
import pytest
from distributed import Client, LocalCluster

import dask_services

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["bench", "--help"]])
def test_help_is_plain_text(argv, capsys):
    from dask_services.cli import main

    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert "usage: dask-services" in out
    assert "``" not in out  # no reStructuredText markup from a docstring


def test_the_dashboard_hint_installs_the_extra_with_this_interpreter():
    from dask_services.cli import dashboard_hint

    hint = dashboard_hint()
    # a checkout is not on an index: name the extra's requirements, not the package
    assert "dask-services[" not in hint
    assert hint.startswith(f"{shlex.quote(sys.executable)} -m pip install ")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["dashboard"]
    assert sorted(shlex.split(hint)[4:]) == sorted(extra)


def test_the_demo_does_not_print_dask_p2p_warnings(caplog):
    """The demo runs dask's p2p shuffle for comparison; its WARNING lines at the start and
    end of every shuffle are not part of what the demo shows."""
    import dask.dataframe as dd

    from dask_services.cli import quiet_dask_logs

    caplog.set_level(logging.INFO)
    pdf = pd.DataFrame({"k": range(200), "x": range(200)})
    df = dd.from_pandas(pdf, npartitions=4)
    with LocalCluster(n_workers=2, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        before = logging.getLogger("distributed.shuffle").level
        with quiet_dask_logs(client):
            assert len(client.compute(df.shuffle("k", shuffle_method="p2p")).result()) == 200
        noisy = [r.getMessage() for r in caplog.records
                 if r.name.startswith("distributed.shuffle") and r.levelno >= logging.WARNING]
        assert noisy == []
        assert logging.getLogger("distributed.shuffle").level == before  # restored


class Echo(dask_services.Service):
    @dask_services.endpoint
    async def echo(self, x):
        return x


def test_closing_a_cluster_with_a_deployed_service_logs_no_warning(caplog):
    caplog.set_level(logging.INFO, logger="dask_services")
    with LocalCluster(n_workers=2, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        svc = Echo.options(replicas=2).as_service(client=client)
        assert svc.echo.route(3).result() == 3
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "dask_services" and r.levelno >= logging.WARNING]
    assert warnings == []


def test_every_public_exception_is_exported_at_the_top_level():
    import dask_services.replicated._errors as replicated_errors
    from dask_services import _spill, service

    # retried, or turned into ServiceUnavailable, inside the package: never raised to a caller
    internal = {"ReplicaGone", "ScaledDown", "CallMoved"}
    for module in (service, replicated_errors, _spill):
        for name, obj in vars(module).items():
            if (isinstance(obj, type) and issubclass(obj, Exception)
                    and obj.__module__ == module.__name__ and not name.startswith("_")
                    and name not in internal):
                assert name in dask_services.__all__, name
                assert getattr(dask_services, name) is obj
    from dask_services import DeploymentError, EndpointRefused  # noqa: F401


def test_the_benchmarks_cluster_uses_a_long_tcp_timeout(monkeypatch):
    """``dask-services bench`` starts its cluster with a long kernel-level TCP timeout
    (``design/architecture.md``, "Lost client connections"): the client's own socket to the
    scheduler carries it, and the setting is gone once the benchmark's client closes."""
    import argparse
    import socket

    import dask
    from dask.utils import parse_timedelta

    from dask_services import cli

    def small_cluster(workers, threads, processes, **kwargs):
        return LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                            protocol="tcp", dashboard_address=None, **kwargs)

    monkeypatch.setattr(cli, "_local_cluster", small_cluster)
    args = argparse.Namespace(workers=1, threads=1)
    wanted = int(parse_timedelta(cli.BENCH_TCP_TIMEOUT) * 1000)
    assert wanted > 30_000
    with cli._bench_client(args) as client:
        sock = client.scheduler_comm.comm.stream.socket
        if sys.platform.startswith("linux"):
            TCP_USER_TIMEOUT = 18
            assert sock.getsockopt(socket.SOL_TCP, TCP_USER_TIMEOUT) == wanted
        assert dask.config.get("distributed.comm.timeouts.tcp") == cli.BENCH_TCP_TIMEOUT
    assert dask.config.get("distributed.comm.timeouts.tcp") != cli.BENCH_TCP_TIMEOUT


class _TypoInPeerCall(dask_services.Service):
    async def all_inputs_done(self) -> None:
        for peer in self.peers.values():
            await peer.recieve()  # a typo for receive

    @dask_services.rpc
    async def receive(self) -> int:
        return 1


def test_a_peer_call_to_a_method_the_class_lacks_names_the_rpc_methods_it_has():
    import dask

    with pytest.raises(dask_services.RPCRefused,
                       match=r"_TypoInPeerCall has no method 'recieve' to call on peers "
                             r"\(its @rpc methods: \['receive'\]\)"):
        dask.compute(*dask_services.service_task(_TypoInPeerCall, [], outputs=1),
                     scheduler="sync")


def test_misused_arguments_are_named_with_the_fix():
    import dask
    import dask.array  # noqa: F401
    import numpy as np

    from dask_services import Buffers, ServiceGraphError
    from dask_services.array import rechunk
    from dask_services.examples import AllReduce

    x = dask.delayed(1, name="twice")
    with pytest.raises(ServiceGraphError, match=r"input key 'twice' was given twice.*"
                                                r"pure=False"):
        dask_services.service_task(AllReduce, [x, x], outputs=1)
    with pytest.raises(TypeError, match=r"a list of numpy arrays, got one array: write "
                                        r"Buffers\(\[array\]\)"):
        Buffers(np.ones(3))
    with pytest.raises(TypeError, match=r"takes a dask Array, got numpy.ndarray; make one "
                                        r"with dask.array.from_array"):
        rechunk(np.ones(3), 2)


@pytest.mark.parametrize("replicas, message", [
    (-1, r"options\(replicas=...\) must be an integer >= 1, got -1$"),
    ("2", r"must be an integer >= 1, got '2'$"),
    (0, r"must be an integer >= 1, got 0; to stop a service call svc.shutdown\(\)"),
])
def test_a_bad_replica_count_gets_one_message(replicas, message):
    from replicated_services import Adder

    with pytest.raises(ValueError, match=message):
        Adder.options(replicas=replicas)


@pytest.mark.parametrize("bad", [("a", None), b"raw", None, ("a", object())])
def test_an_output_key_dask_refuses_is_refused_naming_it(bad):
    """A tuple holding something that is not a key passed the check and failed only at
    compute time, with dask's own message."""
    from dask_services.examples import AllReduce

    with pytest.raises(TypeError, match="is not a valid dask key"):
        dask_services.service_task(AllReduce, [dask.delayed(1)], outputs=["ok", bad])


def test_float_output_keys_are_keys_as_dask_has_them():
    """Float keys, which dask and distributed accept, were refused."""
    from dask_services.examples import AllReduce

    inputs = [dask.delayed(i) for i in range(4)]
    by_float = dask_services.service_task(AllReduce, inputs, outputs=[1.5, ("b", 2.5)])
    by_name = dask_services.service_task(AllReduce, inputs, outputs=["x", "y"])
    assert [o.key for o in by_float] == [1.5, ("b", 2.5)]
    assert dask.compute(*by_float, scheduler="sync") == \
        dask.compute(*by_name, scheduler="sync")
