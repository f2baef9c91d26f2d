"""The dashboard's Services page in a real browser: headless Chromium, driven over the
DevTools protocol, loads the page of a cluster with a shuffle in progress and a deployed
replicated service, waits for Bokeh to render it, and checks that the plots and tables
have content.  Chromium is installed from the system packages (``apt-get install
chromium``) once per session when it is missing; the test is skipped, saying why, only
when that fails.  ``DASK_SERVICES_SCREENSHOT=path.png`` also saves a screenshot there (how
``design/services-page.png`` is made)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--window-size=1500,1400", "--no-proxy-server")


def find_browser() -> str | None:
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


@pytest.fixture(scope="session")
def chromium() -> str:
    """A Chromium binary: the system's, or Debian's ``chromium`` package installed now."""
    found = find_browser()
    if found:
        return found
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("no Chromium found, and it cannot be installed here (apt-get as root "
                    "is needed: apt-get update && apt-get install -y chromium)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        for command in (["apt-get", "update"], ["apt-get", "install", "-y", "chromium"]):
            subprocess.run(command, check=True, env=env, timeout=480,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except (subprocess.SubprocessError, OSError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        pytest.skip(f"Chromium is missing and `apt-get install -y chromium` failed: {exc} "
                    f"{detail.decode(errors='replace')[-300:]}")
    found = find_browser()
    if not found:
        pytest.skip("apt-get installed chromium, but no chromium binary is on PATH")
    return found


class DevTools:
    """The few DevTools protocol commands the test needs, over tornado's websocket."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ws = None
        self.next_id = 0

    async def __aenter__(self) -> DevTools:
        from tornado.websocket import websocket_connect

        self.ws = await websocket_connect(self.url, max_message_size=256 * 2**20)
        return self

    async def __aexit__(self, *exc) -> None:
        self.ws.close()

    async def send(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.write_message(json.dumps({"id": self.next_id, "method": method,
                                          "params": params}))
        while True:
            message = await asyncio.wait_for(self.ws.read_message(), 30)
            if message is None:
                raise ConnectionError("the browser closed the DevTools connection")
            reply = json.loads(message)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    async def evaluate(self, expression: str):
        result = await self.send("Runtime.evaluate", expression=expression,
                                 returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")


# What the browser shows: the data of each plot's glyphs as BokehJS holds them, and the
# text of every table cell SlickGrid rendered (Bokeh 3 draws inside shadow roots).
PAGE_STATE = """
(() => {
  if (!window.Bokeh || !Bokeh.documents || !Bokeh.documents.length) return null;
  const doc = Bokeh.documents[0];
  const column = (source, name) => {
    const data = source.data;
    const values = data instanceof Map ? data.get(name) : data[name];
    return values ? Array.from(values) : [];
  };
  const source = (figure) => {
    const model = doc.get_model_by_name(figure);
    return model ? model.renderers[0].data_source : null;
  };
  const sum = (xs) => xs.reduce((a, b) => a + (Number.isFinite(b) ? b : 0), 0);
  const workers = source("dask-services-bytes-per-worker");
  const runs = source("dask-services-timeline");
  const rate = source("dask-services-calls-per-second");
  const states = source("dask-services-replica-states");
  const latency = doc.get_model_by_name("dask-services-latency");
  const cells = [];
  let canvases = 0;
  const walk = (root) => {
    for (const el of root.querySelectorAll("*")) {
      if (el.classList && el.classList.contains("slick-cell")) cells.push(el.textContent);
      if (el.tagName === "CANVAS" && el.width > 0 && el.height > 0) canvases += 1;
      if (el.shadowRoot) walk(el.shadowRoot);
    }
  };
  walk(document);
  return {
    workers: workers ? column(workers, "worker") : [],
    memory: workers ? sum(column(workers, "memory_bytes")) : 0,
    inputs: workers ? sum(column(workers, "inputs")) : 0,
    runs: runs ? column(runs, "service") : [],
    rate_points: rate ? sum(column(rate, "xs").map((xs) => xs.length)) : 0,
    p99_points: latency ? sum(column(latency.renderers[1].data_source, "xs")
                                  .map((xs) => xs.length)) : 0,
    healthy: states ? sum(column(states, "healthy")) : 0,
    cells, canvases,
  };
})()
"""


def part(i: int) -> pd.DataFrame:
    """Input partition ``i`` of the shuffle; the last one waits for ``GATE``, so the
    shuffle stays in progress while the page is open.  One only: it holds a task thread
    while it waits, and two of them on one worker (of two threads) could keep that worker's
    other hand-offs from running."""
    if i == 7:
        GATE.wait(60)
    rng = np.random.default_rng(i)
    n = 20_000
    return pd.DataFrame({"key": rng.integers(0, 10**6, n), "x": rng.random(n)})


GATE = threading.Event()


def ready(state: dict | None) -> bool:
    if not state:
        return False
    text = " ".join(state["cells"])
    return (state["memory"] > 0 and state["inputs"] >= 6 and len(state["workers"]) == 2
            and "DataFrameShuffle" in state["runs"] and state["rate_points"] >= 2
            and state["p99_points"] >= 2 and state["healthy"] == 2
            and "DataFrameShuffle" in text and "adder" in text
            and (" kB" in text or " MB" in text))


@pytest.mark.slow
@pytest.mark.timeout(600)  # the page itself takes about 20 s; installing Chromium more
def test_the_services_page_renders_plots_and_tables_in_chromium(chromium, tmp_path):
    pytest.importorskip("bokeh")
    from distributed import Client, LocalCluster
    from replicated_services import Adder

    import dask_services

    GATE.clear()
    with LocalCluster(n_workers=2, threads_per_worker=2, processes=False,
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        dask_services.install(client)
        svc = Adder.options(replicas=2, name="adder").as_service(1, client=client)
        df = dd.from_map(part, range(8), meta=part(0).iloc[:0], enforce_metadata=False)
        shuffled = client.persist(df.shuffle("key", shuffle_method="service"))

        # Opened once the run's figures are reported: in headless Chromium the page's tables
        # keep their first rendering (the plots redraw), so bytes reported later would
        # never show in the cells read below.
        def reported() -> bool:
            rows = dask_services.status(client).to_dict("records")
            return bool(rows) and rows[0]["inputs_handed_off"] >= 6 \
                and rows[0]["bytes_sent"] > 0
        deadline = time.monotonic() + 30
        while not reported():
            assert time.monotonic() < deadline, dask_services.status(client)
            time.sleep(0.1)

        stop_calls = threading.Event()

        def call_replicas() -> None:  # calls keep coming while the page is open
            while not stop_calls.is_set():
                svc.add.route(1).result()

        caller = threading.Thread(target=call_replicas, daemon=True)
        caller.start()
        port = client.scheduler_info()["services"]["dashboard"]
        url = f"http://127.0.0.1:{port}/services"
        try:
            state, png = asyncio.run(load(chromium, url, tmp_path))
        finally:
            stop_calls.set()
            caller.join(10)
            GATE.set()
        target = os.environ.get("DASK_SERVICES_SCREENSHOT")
        if target:
            Path(target).write_bytes(png)
        assert ready(state), json.dumps({k: v for k, v in (state or {}).items()
                                         if k != "cells"}) + f" cells: {state and state['cells']}"
        assert state["canvases"] >= 5  # the plots were drawn
        cells = state["cells"]
        assert any(c.endswith((" kB", " MB")) for c in cells), cells  # readable bytes
        assert any(c.strip().replace(".", "", 1).isdigit() and "." in c for c in cells)
        assert len(png) > 10_000
        assert len(client.compute(shuffled.map_partitions(len)).result()) == 8
        svc.shutdown()


async def load(chromium: str, url: str, tmp_path: Path) -> tuple[dict, bytes]:
    """Open ``url`` in headless Chromium until the page shows content; its state and a
    screenshot."""
    import base64

    profile = tempfile.mkdtemp(dir=tmp_path, prefix="chromium-profile-")
    process = subprocess.Popen(
        [chromium, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
         "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = Path(profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            assert process.poll() is None, f"{chromium} exited with {process.returncode}"
            assert time.monotonic() < deadline, "Chromium did not open its DevTools port"
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            pages = [t for t in json.load(r) if t["type"] == "page"]
        async with DevTools(pages[0]["webSocketDebuggerUrl"]) as tab:
            await tab.send("Page.enable")
            await tab.send("Page.navigate", url=url)
            state = None
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline:
                state = await tab.evaluate(PAGE_STATE)
                if ready(state):
                    break
                await asyncio.sleep(0.25)
            shot = await tab.send("Page.captureScreenshot", format="png")
            return state, base64.b64decode(shot["data"])
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


# ------------------------------------------------------------------ the page's figures


def test_replica_history_counts_calls_per_second_across_relaunches():
    from dask_services.dashboard import ReplicaHistory

    history = ReplicaHistory()
    row = {"service": "s", "replica": "a.1", "calls": 10, "p50_ms": 1.0, "p99_ms": 2.0}
    history.sample([row], 100.0)
    history.sample([dict(row, calls=30)], 102.0)  # 20 calls in 2 s
    # relaunched: a new incarnation counts from zero, its calls are new ones
    history.sample([dict(row, replica="a.2", calls=5, p99_ms=9.0)], 103.0)
    rate = history.lines("rate")
    assert rate["service"] == ["s"]
    assert rate["ys"] == [[10.0, 5.0]] and rate["xs"] == [[102_000.0, 103_000.0]]
    assert history.lines("p99")["ys"] == [[2.0, 2.0, 9.0]]


def test_readable_bytes_and_addresses():
    from dask_services.dashboard import human_bytes, short_address

    assert [human_bytes(n) for n in (0, 999, 1234, 5_600_000, 7.2e9)] == [
        "0 B", "999 B", "1.2 kB", "5.6 MB", "7.2 GB"]
    assert short_address("tcp://127.0.0.1:4000") == "127.0.0.1:4000"
