"""The README runs as written: every Python snippet, pasted in order after the Quickstart,
with warnings turned into errors; its error tables name exceptions the package exports;
CI runs its test command verbatim."""

from __future__ import annotations

import builtins
import re
import textwrap
import warnings
from pathlib import Path

import dask
import pytest

import dask_services

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def blocks(lang: str = "python") -> list[str]:
    """The README's code blocks (those indented in a list item too, dedented)."""
    found = re.findall(rf"^( *)```{lang}\n(.*?)^ *```", README.read_text(), flags=re.S | re.M)
    return [textwrap.dedent(body) for _, body in found]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_readme_examples_run_as_written_without_warnings():
    found = blocks()
    assert "client = Client()" in found[0]  # the Quickstart comes first
    from distributed import Client

    ns: dict = {"__name__": "__main__"}  # as pasted into a script or a session
    clients: list = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            # the Quickstart's Client() takes another port when 8787 is busy (other tests)
            warnings.filterwarnings("ignore", "Port 8787 is already in use")
            for i, block in enumerate(found):
                exec(compile(block, f"README-block-{i}", "exec"), ns)
                clients += [c for c in ns.values() if isinstance(c, Client)
                            and all(c is not known for known in clients)]
                if i == 0:
                    assert ns["client"].gather(ns["futures"]) == [45, 45]
                    assert dask.compute(*ns["outs"]) == (45, 45, 45)
                if "class Histogram" in block:
                    hist = ns["dask_services"].service_task(
                        ns["Histogram"],
                        [dask.delayed([0.05, 0.15, 0.95]), dask.delayed([0.5])],
                        outputs=2, bins=10,
                    )
                    expected = [1, 1, 0, 0, 0, 1, 0, 0, 0, 1]
                    assert dask.compute(*hist) == (expected, expected)  # on the cluster
                    assert dask.compute(*hist, scheduler="sync") == (expected, expected)
                if "class Model" in block:
                    assert ns["y"] == [2, 4] and ns["total"] == 6 and ns["a"] == ns["b"]
                if "dask_services.story(" in block:
                    assert ns["e"]["kind"] in ("received", "decided", "sent")
    finally:
        for client in reversed(clients):
            cluster = client.cluster
            client.close()
            if cluster is not None:
                cluster.close()


def test_every_snippet_is_run():
    """Each snippet stands on its own after the Quickstart: no name it uses is left for
    the reader to define (the old ones used df, left, right and f without defining them)."""
    found = blocks()
    text = "\n".join(found)
    for name in ("df", "left", "right", "f", "x", "svc"):
        uses = re.search(rf"\b{name}\b[.\[(]|\b{name}\b,", text)
        if uses:
            assert re.search(rf"^\s*(def\s+)?{name}\b.*[=(]", text, flags=re.M) or \
                re.search(rf"^\s*{name}\s*,|,\s*{name}\s*=", text, flags=re.M), name


def error_names() -> set[str]:
    """Exception names in the first column of the README's error tables (``| error |`` and
    ``| message |`` headers), such as ``ServiceOverloaded`` or ``EndpointRefused: ...``."""
    names: set[str] = set()
    table = False
    for line in README.read_text().splitlines():
        if line.startswith("| error |") or line.startswith("| message |"):
            table = True
            continue
        if not line.startswith("|"):
            table = False
            continue
        if table:
            cell = line.split("|")[1]
            found = re.match(r"\s*`([A-Z][A-Za-z]+)(?::|`)", cell)
            if found and not hasattr(builtins, found.group(1)):
                names.add(found.group(1))
    return names


def test_the_error_tables_name_exceptions_the_package_exports():
    names = error_names()
    assert {"ServiceOverloaded", "EndpointRefused", "DeploymentError", "TooManyRestarts",
            "OutOfDiskError", "ServiceGraphError"} <= names, names
    missing = sorted(n for n in names if n not in dask_services.__all__)
    assert not missing, f"in the README's error tables but not in dask_services: {missing}"
    for name in names:
        assert issubclass(getattr(dask_services, name), Exception), name


def test_ci_runs_the_readme_test_command_verbatim():
    commands = [b.strip() for b in blocks("bash")]
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command.startswith("python3 -m venv .venv && . .venv/bin/activate")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci
    assert ci[ci.index(test_command) - 1] == "# --- the README's test command, verbatim ---"


def test_the_readme_shows_the_services_page():
    shot = re.search(r"!\[[^\]]*\]\((design/services-page\.png)\)", README.read_text())
    assert shot and (ROOT / shot.group(1)).stat().st_size > 10_000


def metric_families() -> set[str]:
    """The Prometheus families of the README's *Metrics* table."""
    return set(re.findall(r"^\| `(dask_services_[a-z0-9_]+)` \|", README.read_text(),
                          flags=re.M))


def test_the_notebooks_name_only_metric_families_that_exist():
    families = metric_families()
    assert "dask_services_replica_calls_total" in families
    suffixes = ("", "_count", "_sum", "_bucket")
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for name, star in re.findall(r"(dask_services_[a-z0-9_]+)(\*?)", notebook.read_text()):
            if star:  # a prefix: it must name some family
                assert any(f.startswith(name) for f in families), (notebook.name, name + "*")
            else:
                assert any(name == f + s for f in families for s in suffixes), (
                    notebook.name, name)


def test_the_configuration_table_has_every_setting_of_the_packaged_config():
    """Each setting in ``dask_services.yaml`` has its row in the README's configuration
    table, and each row names a setting there is."""
    import yaml

    def leaves(tree: dict, prefix: str) -> set[str]:
        found = set()
        for name, value in tree.items():
            path = f"{prefix}.{name}"
            found |= leaves(value, path) if isinstance(value, dict) else {path}
        return found

    packaged = yaml.safe_load(
        (ROOT / "dask_services" / "dask_services.yaml").read_text())["dask_services"]
    settings = leaves(packaged, "dask_services")
    rows = set(re.findall(r"^\| `(dask_services\.[\w.-]+)` \|", README.read_text(), re.M))
    assert not settings - rows, f"settings without a README row: {sorted(settings - rows)}"
    assert not rows - settings, f"README rows naming no setting: {sorted(rows - settings)}"
