"""``dask-services status``: a running cluster's status tables from the command line, the
same rows as ``dask_services.status()``, and clear refusals with their exit codes."""

from __future__ import annotations

import json

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest

import dask_services
from dask_services.cli import main

pytestmark = pytest.mark.timeout(120)


class Echo(dask_services.Service):
    @dask_services.endpoint
    async def echo(self, x):
        return x


@pytest.fixture(scope="module")
def cluster_with_services():
    """A cluster (tcp, validation on) that ran a service shuffle and has a replicated
    service deployed; yields (scheduler address, client)."""
    from distributed import Client, LocalCluster

    with dask.config.set({"distributed.scheduler.validate": True,
                          "distributed.worker.validate": True}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                         protocol="tcp://", dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        pdf = pd.DataFrame({"a": np.arange(400) % 17, "b": np.arange(400.0)})
        got = dd.from_pandas(pdf, npartitions=8).shuffle(
            "a", shuffle_method="service").b.sum().compute()
        assert got == pdf.b.sum()
        svc = Echo.options(replicas=2, name="cli-echo").as_service(client=client)
        assert svc.echo.route(3).result() == 3
        yield cluster.scheduler_address, client
        svc.shutdown()


def _status(argv, capsys):
    code = main(["status", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_runs_table_is_the_apis(cluster_with_services, capsys):
    address, client = cluster_with_services
    code, out, err = _status([address, "--json"], capsys)
    assert code == 0 and err == ""
    rows = json.loads(out)
    expected = dask_services.status(client)
    assert [r["run_id"] for r in rows] == expected["run_id"].tolist()
    assert [r["state"] for r in rows] == expected["state"].tolist() == ["finished"]
    assert rows[0]["service"] == "DataFrameShuffle" and rows[0]["outputs_produced"] == 8


def test_table_columns_and_text(cluster_with_services, capsys):
    address, _ = cluster_with_services
    # spaces after the commas, as people write lists
    code, out, _ = _status([address, "--columns", "service, state, outputs_produced"],
                           capsys)
    assert code == 0
    header, row = out.strip().splitlines()
    assert header.split() == ["service", "state", "outputs_produced"]
    assert row.split() == ["DataFrameShuffle", "finished", "8"]


def _strict(constant):
    raise ValueError(f"not JSON: {constant}")


def test_replicas_table(cluster_with_services, capsys):
    address, _ = cluster_with_services
    code, out, _ = _status([address, "--table", "replicas", "--json", "--columns",
                            "service,state"], capsys)
    assert code == 0
    assert json.loads(out) == [{"service": "cli-echo", "state": "healthy"}] * 2
    # every column: a replica with no calls yet has no latency (NaN in the frame), which
    # is null in strict JSON
    code, out, _ = _status([address, "--table", "replicas", "--json"], capsys)
    rows = json.loads(out, parse_constant=_strict)
    assert len(rows) == 2 and any(r["p99_ms"] is None for r in rows), rows


def test_scheduler_file_and_config_address(cluster_with_services, capsys, tmp_path):
    address, client = cluster_with_services
    path = tmp_path / "scheduler.json"
    # what `dask scheduler --scheduler-file` writes as it starts (Client.write_scheduler_file
    # fails once a worker's heartbeat metrics have tuple keys, which JSON cannot hold)
    identity = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.identity(0))
    path.write_text(json.dumps(identity))
    code, out, _ = _status(["--scheduler-file", str(path), "--json"], capsys)
    assert code == 0 and json.loads(out)[0]["state"] == "finished"
    with dask.config.set({"scheduler-address": address}):
        code, out, _ = _status(["--json", "--columns", "state"], capsys)
    assert code == 0 and json.loads(out) == [{"state": "finished"}]


def test_unknown_table_or_column_names_what_there_is(cluster_with_services, capsys):
    address, _ = cluster_with_services
    code, out, err = _status([address, "--table", "nope"], capsys)
    assert code == 2 and out == ""
    assert "no status table 'nope'" in err and "'replicas', 'runs'" in err
    code, out, err = _status([address, "--columns", "state,bogus"], capsys)
    assert code == 2 and out == ""
    assert "no column 'bogus'" in err and "run_id" in err


def test_unreachable_scheduler_fails_within_the_timeout(capsys):
    from distributed.utils import open_port

    address = f"tcp://127.0.0.1:{open_port()}"  # nothing listens there
    code, out, err = _status([address, "--timeout", "1s"], capsys)
    assert code == 1 and out == ""
    assert f"could not reach the scheduler at {address} within 1s" in err
    assert "Traceback" not in err


@pytest.fixture
def listener():
    """A local TCP port whose peer accepts connections and then answers with
    ``reply`` (b"": never answers); yields a function ``reply -> address``."""
    import socket
    import threading

    sockets, threads, stop = [], [], threading.Event()

    def serve(server, reply):
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            sockets.append(conn)
            if reply:
                conn.sendall(reply)

    def start(reply):
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        sockets.append(server)
        threads.append(threading.Thread(target=serve, args=(server, reply), daemon=True))
        threads[-1].start()
        return f"tcp://127.0.0.1:{server.getsockname()[1]}"

    yield start
    stop.set()
    for thread in threads:
        thread.join()
    for sock in sockets:
        sock.close()


def test_a_port_that_never_answers_fails_within_the_timeout(listener, capsys):
    import time

    address = listener(b"")
    began = time.monotonic()
    code, out, err = _status([address, "--timeout", "1s"], capsys)
    assert code == 1 and out == ""
    assert f"could not reach the scheduler at {address} within 1s: no answer" in err
    assert time.monotonic() - began < 10  # it waited for ever before
    assert "Traceback" not in err


def test_a_port_answering_as_something_else_is_named(listener, capsys):
    address = listener(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
    code, out, err = _status([address, "--timeout", "5s"], capsys)
    assert code == 1 and out == ""
    assert "it answered, but not as a dask scheduler does" in err
    assert "Traceback" not in err


def test_a_missing_scheduler_file_is_named(tmp_path, capsys):
    missing = tmp_path / "nowhere.json"
    code, out, err = _status(["--scheduler-file", str(missing), "--timeout", "1s"], capsys)
    assert code == 1 and out == ""
    assert f"no scheduler file at {missing}" in err


@pytest.mark.parametrize("argv, named", [
    ([], "no scheduler to ask: give its address"),
    (["tcp://a:1", "--scheduler-file", "f.json"], "not both"),
    (["tcp://a:1", "--timeout", "soon"], "--timeout takes a duration"),
    (["tcp://a:1", "--table", ""], "--table takes a table's name"),
    (["tls://a:1", "--tls-ca-file", "no-such-ca.pem"], "--tls-ca-file: no such file"),
])
def test_bad_arguments_are_refused_before_connecting(argv, named, capsys, monkeypatch):
    monkeypatch.delenv("DASK_SCHEDULER_ADDRESS", raising=False)
    with dask.config.set({"scheduler-address": None}), pytest.raises(SystemExit) as exit_:
        main(["status", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_a_reader_that_goes_away_ends_the_command_quietly(cluster_with_services):
    """``dask-services status | head -1``: the output's reader has gone when the table is
    printed."""
    import subprocess
    import sys

    address, _ = cluster_with_services
    proc = subprocess.Popen([sys.executable, "-m", "dask_services", "status", address],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before anything is written: the first write finds no reader
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()
