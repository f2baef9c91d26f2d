"""distributed's own p2p test suites, run with the ``service`` methods.

distributed does not install its tests; give the ``distributed/shuffle/tests`` folder of a
source checkout of the installed version (``git clone https://github.com/dask/distributed``
and check out the tag)::

    python benchmarks/distributed_suites.py /path/to/distributed/distributed/shuffle/tests
    python benchmarks/distributed_suites.py TESTS --modules test_rechunk -k cull

The test modules (``test_rechunk``, ``test_merge``, ``test_merge_column_and_index`` and
``test_shuffle`` by default) are copied into a temporary package, where every
``method="p2p"``, ``shuffle_method="p2p"`` and ``"dataframe.shuffle.method": "p2p"`` becomes
``"service"``, and a ``conftest.py`` imports dask_services.  Each module runs in its own
pytest process (pytest-timeout, ``--timeout`` seconds per test); the failing tests are
printed per module.

Many of those tests look at p2p's own machinery (its worker and scheduler plugins, shuffle
runs, barrier keys, ``P2P ... failed`` messages, the ``shuffle-transfer`` prefix) and fail
or time out with any other method: the failures need reading one by one.  Measured with
the tests of distributed's repository at 40fcd99 (July 2026) against distributed 2026.8.0:
``test_rechunk`` 135 of 138 pass (the 3 others read p2p's runs, barrier keys or task
groups), ``test_merge`` and ``test_merge_column_and_index`` 73 of 76 (the 3 count p2p's
shuffle ids or wait for its run manager), ``test_shuffle`` 153 of 197 (142 before the
fixes below, and 8 more once the generated ``conftest.py`` gave the fixtures distributed's
own conftest gives; the others wait for p2p's runs, check its errors or mock its classes;
``test_handle_null_partitions_2``, which p2p fails with pandas 3 and marks as a strict
xfail, passes, so it is listed).  The differences they found in the package, now
fixed: a culled rechunk kept inputs its wanted outputs do not need
(``test_cull_p2p_rechunk_overlapping_partitions``), an asynchronous client used before it
connected did not install (``test_basic_integration_local_cluster``), an adaptive cluster
could retire a worker a running service task needs
(``test_dont_downscale_participating_workers``), and the worker's ``dask-services``
directory stayed after its runs (``test_head``).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

MODULES = ("test_rechunk", "test_merge", "test_merge_column_and_index", "test_shuffle")
PACKAGE = "service_suites"
SUBSTITUTIONS = [
    (re.compile(r'method="p2p"'), 'method="service"'),  # shuffle_method= too
    (re.compile(r'"dataframe\.shuffle\.method": "p2p"'), '"dataframe.shuffle.method": "service"'),
    (re.compile(r"\bfrom distributed\.shuffle\.tests\b"), f"from {PACKAGE}"),
]


def adapted(source: str) -> str:
    """A test module's text with the p2p methods it asks for made ``service``."""
    for pattern, replacement in SUBSTITUTIONS:
        source = pattern.sub(replacement, source)
    return source


def prepare(tests: Path, root: Path) -> Path:
    """The adapted copy of every module of ``tests`` in the package ``root/PACKAGE``."""
    package = root / PACKAGE
    package.mkdir()
    for path in tests.glob("*.py"):
        (package / path.name).write_text(adapted(path.read_text()))
    # dask_services, and the fixtures distributed's own conftest makes available
    (package / "conftest.py").write_text(
        "import dask_services  # noqa: F401\n"
        "from distributed.utils_test import (  # noqa: F401\n"
        "    cleanup, client, client_secondary, cluster_fixture, loop, loop_in_thread)\n")
    (root / "pytest.ini").write_text("[pytest]\n")
    return package


def failures(xml: Path) -> list[str]:
    """The tests that failed or errored, from a junit xml report."""
    failed = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        if any(child.tag in ("failure", "error") for child in case):
            failed.append(case.get("name", "?"))
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", type=Path, help="distributed/shuffle/tests of a checkout")
    parser.add_argument("--modules", default=",".join(MODULES))
    parser.add_argument("-k", default=None, help="pytest -k expression")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test")
    args = parser.parse_args(argv)
    if not (args.tests / "test_rechunk.py").exists():
        parser.error(f"{args.tests} holds no test_rechunk.py: give distributed/shuffle/tests")
    root = Path(tempfile.mkdtemp(prefix="distributed-suites-"))
    try:
        package = prepare(args.tests, root)
        for module in args.modules.split(","):
            xml = root / f"{module}.xml"
            cmd = [sys.executable, "-m", "pytest", "-c", str(root / "pytest.ini"),
                   "--rootdir", str(root), "-p", "no:cacheprovider", "-q", "-W", "ignore",
                   f"--timeout={args.timeout}", f"--junitxml={xml}",
                   str(package / f"{module}.py")]
            if args.k:
                cmd += ["-k", args.k]
            done = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
            summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
            print(f"{module}: {summary}")
            for name in failures(xml) if xml.exists() else []:
                print(f"    {name}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
