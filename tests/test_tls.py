"""Everything works on a TLS-only cluster, and nothing answers without its certificates.

One ``LocalCluster(protocol="tls", security=Security.temporary())`` of two worker processes
for the whole module.  ``Security.temporary()`` requires encryption and a client
certificate signed by the cluster's own authority, and the scheduler and the workers listen
on ``tls://`` only: a service task, a shuffle, a rechunk and a replicated service that
complete here sent their control messages, peer RPCs, data, replica calls and health probes
over TLS with the cluster's certificates.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Client, LocalCluster
from distributed.comm.core import CommClosedError
from distributed.core import rpc
from distributed.protocol.serialize import to_serialize
from distributed.security import Security

import dask_services
from dask_services.examples import AllReduce

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

RECORDED_OPS = ("replicated_call", "service_rpc")


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """(cluster, client, security) of a TLS-only cluster with two worker processes."""
    security = Security.temporary()
    config = {
        "temporary-directory": str(tmp_path_factory.mktemp("tls")),
        "dask_services.replicated.health-check-period": "100ms",
    }
    with dask.config.set(config), LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, protocol="tls",
        security=security, dashboard_address=":0",
    ) as cluster, Client(cluster, security=security) as client:
        dask_services.install(client)
        yield cluster, client, security


def test_the_cluster_is_tls_only(tls):
    cluster, client, security = tls
    assert security.require_encryption
    workers = client.scheduler_info()["workers"]
    assert len(workers) == 2
    assert cluster.scheduler_address.startswith("tls://")
    assert all(addr.startswith("tls://") for addr in workers)
    assert all(w["nanny"].startswith("tls://") for w in workers.values())


def test_service_task_with_peer_rpc(tls):
    _, client, _ = tls
    futures = dask_services.submit(AllReduce, client.map(abs, range(10)), outputs=2,
                                   client=client)
    assert client.gather(futures) == [45, 45]
    runs = dask_services.status(client)
    run = runs[runs.service == "AllReduce"].iloc[-1]
    assert run.state == "finished" and run.workers == 2  # partials crossed between workers


def test_shuffle(tls):
    _, client, _ = tls
    rng = np.random.default_rng(0)
    pdf = pd.DataFrame({"x": rng.integers(0, 50, 2_000), "y": rng.random(2_000),
                        "s": [f"v{i}" for i in range(2_000)]})
    df = dd.from_pandas(pdf, npartitions=6)
    shuffled = df.shuffle("x", shuffle_method="service")
    parts = client.compute(shuffled.to_delayed(), sync=True)
    result = pd.concat(parts).astype({"s": object})  # dask made it an arrow string column
    pd.testing.assert_frame_equal(result.sort_index(), pdf.astype({"s": object}))
    homes = [set(p.x) for p in parts]
    assert all(not (a & b) for i, a in enumerate(homes) for b in homes[i + 1:])


def test_rechunk(tls):
    _, client, _ = tls
    arr = np.arange(240 * 180, dtype="f8").reshape(240, 180)
    x = da.from_array(arr, chunks=(24, 180))
    y = x.rechunk((240, 18), method="service")
    assert y.chunks == x.rechunk((240, 18), method="tasks").chunks
    np.testing.assert_array_equal(client.compute(y, sync=True), arr)


class Greeter(dask_services.Service):
    """A replicated service that records its health probes."""

    async def setup(self, greeting: str) -> None:
        self.greeting = greeting
        self.probed = asyncio.Event()

    async def check_health(self) -> bool:
        self.probed.set()
        return True

    @dask_services.endpoint
    async def greet(self, name: str) -> str:
        return f"{self.greeting}, {name}"

    @dask_services.endpoint
    async def whoami(self) -> tuple[str, int]:
        return str(self.id), os.getpid()

    @dask_services.endpoint
    async def was_probed(self) -> bool:
        await self.probed.wait()  # the scheduler's probe reached this replica
        return True

    @dask_services.endpoint
    async def greet_peers(self, name: str) -> list[str]:
        await self.service.refresh()
        return [await self.peers[sid].greet(name) for sid in self.peers if sid != self.id]


def _hosted(dask_worker) -> list[str]:
    return sorted(map(str, dask_worker.extensions["dask_services_replicated"].replicas))


def test_replicated_service(tls):
    _, client, _ = tls
    svc = Greeter.options(replicas=2).as_service("hello", client=client)
    try:
        assert svc.greet.route("tls").result(timeout=30) == "hello, tls"
        replicas = svc.replicas()
        assert len({r["worker"] for r in replicas}) == 2
        assert all(r["worker"].startswith("tls://") for r in replicas)
        where = svc.whoami.fanout().result(timeout=30)
        assert sorted(sid for sid, _ in where) == sorted(str(r["id"]) for r in replicas)
        assert len({pid for _, pid in where}) == 2  # one replica per worker process
        assert svc.was_probed.fanout().result(timeout=30) == [True, True]
        # replica to replica, worker to worker
        assert svc.greet_peers.route("peer").result(timeout=30) == ["hello, peer"]
        # from a task on a worker, through the pickled handle
        assert svc.greet.submit("task", client=client).result(timeout=30) == "hello, task"
        assert sum(m["calls"] for m in svc.metrics()) == 8
    finally:
        svc.shutdown(timeout=10)
    assert not any(client.run(_hosted).values())


# ------------------------------------------------------------------ without the certificates

_recorded: dict[str, int] = {}


def _record_ops(dask_worker) -> None:
    """Replace each handler in RECORDED_OPS by one that counts its calls, then calls it."""
    _recorded.clear()
    for op in RECORDED_OPS:
        handler = dask_worker.handlers[op]

        async def recorder(comm, *, _op=op, _handler=handler, **msg):
            _recorded[_op] = _recorded.get(_op, 0) + 1
            try:
                return await _handler(comm, **msg)
            except Exception as e:  # a made-up peer call: its handler refuses it
                return {"refused": repr(e)}

        recorder.original = handler
        dask_worker.handlers[op] = recorder


def _recorded_ops(dask_worker) -> dict[str, int]:
    return dict(_recorded)


def _unrecord_ops(dask_worker) -> None:
    for op in RECORDED_OPS:
        handler = dask_worker.handlers[op]
        dask_worker.handlers[op] = getattr(handler, "original", handler)


def _no_client_certificate(tls_version: ssl.TLSVersion | None = None) -> dict:
    """TLS that trusts any server but has no certificate of its own to show (at most
    ``tls_version``)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if tls_version is not None:
        ctx.maximum_version = tls_version
    return {"ssl_context": ctx, "require_encryption": True}


async def _attempt(address: str, connection_args: dict, op: str, **msg) -> object:
    """The answer of ``op`` at ``address``, or the exception that stopped it."""
    try:
        async with rpc(address, connection_args=connection_args, timeout=5) as r:
            return await getattr(r, op)(**msg)
    except Exception as e:
        return e


def _chain(exc: BaseException) -> str:
    """The exception and its causes, as text."""
    parts = []
    while exc is not None:
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return " <- ".join(parts)


def test_no_call_without_the_cluster_certificates(tls):
    _, client, security = tls
    svc = Greeter.options(replicas=2).as_service("hello", client=client)
    client.run(_record_ops)
    try:
        replicas = svc.replicas()
        messages = {
            "replicated_call": lambda r: {"id": str(r["id"]), "method": "greet",
                                          "payload": to_serialize((("intruder",), {}))},
            "service_rpc": lambda r: {"target": str(r["id"]), "source": "intruder",
                                      "run_id": -1, "seq": 0, "method": "receive_partial",
                                      "payload": to_serialize(((), {}))},
        }
        others = Security.temporary().get_connection_args("client")
        ways_in = {
            # no security at all: a tls:// address needs an SSL context
            "plain": (lambda a: a, {}, TypeError, "ssl_context"),
            # plain TCP to the TLS port: the worker's TLS handshake fails, the comm closes
            "tcp": (lambda a: a.replace("tls://", "tcp://"), {}, CommClosedError, ""),
            # another authority's certificates: the worker's certificate is not trusted
            "other-ca": (lambda a: a, others, CommClosedError, "CERTIFICATE_VERIFY_FAILED"),
            # trusting any server, without a client certificate: the worker refuses; with
            # TLS 1.2 within the handshake (an SSL error), with TLS 1.3 after the client's
            # side of it (an SSL alert, or the connection reset, as the timing goes: seen
            # with Python 3.13 under load)
            "no-client-cert-tls1.2": (lambda a: a,
                                      _no_client_certificate(ssl.TLSVersion.TLSv1_2),
                                      CommClosedError, "SSL"),
            "no-client-cert": (lambda a: a, _no_client_certificate(), CommClosedError,
                               ("SSL", "Connection reset by peer")),
        }
        for r in replicas:
            for op, make in messages.items():
                for way, (addr, args, exc_type, match) in ways_in.items():
                    answer = asyncio.run(_attempt(addr(r["worker"]), args, op, **make(r)))
                    assert isinstance(answer, exc_type), (way, op, answer)
                    matches = (match,) if isinstance(match, str) else match
                    assert any(m in _chain(answer) for m in matches), (way, op, _chain(answer))
        assert not any(client.run(_recorded_ops).values())  # no handler was reached
        assert sum(m["calls"] for m in svc.metrics()) == 0  # no replica saw a call

        # The same requests with the cluster's certificates reach the handlers.
        mine = security.get_connection_args("client")
        r = replicas[0]
        answer = asyncio.run(_attempt(r["worker"], mine, "replicated_call",
                                      **messages["replicated_call"](r)))
        assert isinstance(answer, dict) and answer.get("status") == "ok", answer
        answer = asyncio.run(_attempt(r["worker"], mine, "service_rpc",
                                      **messages["service_rpc"](r)))
        assert isinstance(answer, dict), answer  # refused: no such run, but reached
        assert client.run(_recorded_ops)[r["worker"]] == {"replicated_call": 1,
                                                          "service_rpc": 1}
        assert sum(m["calls"] for m in svc.metrics()) == 1
    finally:
        client.run(_unrecord_ops)
        svc.shutdown(timeout=10)
    assert not any(client.run(_hosted).values())


def test_the_status_command_takes_the_certificate_files(tls, tmp_path, capsys):
    from dask_services.cli import main

    cluster, client, security = tls
    files = {}
    for option, pem in [("--tls-ca-file", security.tls_ca_file),
                        ("--tls-cert", security.tls_client_cert),
                        ("--tls-key", security.tls_client_key)]:
        path = tmp_path / (option[2:] + ".pem")
        path.write_text(pem)
        files[option] = str(path)
    address = cluster.scheduler_address
    assert main(["status", address, "--table", "replicas", "--json",
                 *[x for item in files.items() for x in item]]) == 0
    assert isinstance(json.loads(capsys.readouterr().out), list)
    # without them: what to give, at once (not a TypeError about an ssl_context)
    with dask.config.set({"distributed.comm.tls.ca-file": None,
                          "distributed.comm.tls.client.cert": None,
                          "distributed.comm.tls.client.key": None}):
        assert main(["status", address]) == 1
    err = capsys.readouterr().err
    assert f"the scheduler at {address} speaks TLS and no certificates were given" in err
    assert "--tls-ca-file, --tls-cert and --tls-key" in err and "ssl_context" not in err
