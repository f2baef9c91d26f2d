"""The command line refuses bad arguments at once (before any cluster starts), naming the
option and what it takes, with argparse's exit code 2 and no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dask_services.cli import main

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("argv, named", [
    (["demo", "--workers", "0"], "--workers must be at least 1, got 0"),
    (["bench", "overhead", "--workers", "-1"], "--workers must be at least 1"),
    (["bench", "overhead", "--repeat", "0"], "--repeat must be at least 1, got 0"),
    (["bench", "shuffle", "--threads", "0"], "--threads must be at least 1"),
    # an option the benchmark would ignore
    (["bench", "overhead", "--sizes", "1GB"], "--sizes does not apply to bench overhead, "
                                              "which takes --workers, --repeat, --json, "
                                              "--quiet"),
    (["bench", "replicated", "--repeat", "5", "--methods", "p2p"],
     "--methods, --repeat do not apply to bench replicated"),
    (["bench", "shuffle", "--local-size", "1GB"], "--local-size does not apply"),
    (["bench", "rechunk", "--no-tiny"], "--no-tiny does not apply to bench rechunk"),
    (["bench", "queries", "--reuse-workers"], "--reuse-workers does not apply"),
    # ... even at its default value (which would start the benchmark)
    (["bench", "rechunk", "--scale", "1"], "--scale does not apply to bench rechunk"),
    (["bench", "overhead", "--methods", "service,p2p,tasks", "--no-tiny"],
     "--no-tiny, --methods do not apply to bench overhead"),
    (["bench", "replicated", "--calls", "0"], "--calls must be at least 1"),
    (["bench", "rechunk", "--chunks", "-5"], "--chunks must be 0"),
    (["bench", "shuffle", "--sizes", "abc"], "--sizes, --local-size and --time-series take"),
    (["bench", "rechunk", "--sizes", "", "--time-series", "big"], "got 'big'"),
    (["bench", "shuffle", "--time-series", "1GB"], "--time-series does not apply"),
    (["bench", "rechunk", "--sizes", "", "--local-size", "0"], "got '0'"),
    (["bench", "shuffle", "--methods", "bogus"], "--methods takes a comma-separated list "
                                                 "of service, p2p, tasks, noop; got "
                                                 "'bogus'"),
    (["bench", "rechunk", "--methods", "noop"], "of service, p2p, tasks; got 'noop'"),
    (["bench", "rechunk", "--methods", "service,bogus"], "got 'service,bogus'"),
    (["bench", "queries", "--methods", ","], "--methods takes"),
    (["bench", "queries", "--scale", "nan"], "--scale takes a positive number"),
    (["bench", "queries", "--scale", "inf"], "--scale takes a positive number"),
    (["bench", "queries", "--scale", "0"], "--scale takes a positive number"),
    (["bench", "queries", "--queries", "q3,q99"], "--queries takes a comma-separated list "
                                                  "of q3, q5"),
    (["bench", "queries", "--queries", ","], "--queries takes a comma-separated list"),
    (["bench", "shuffle", "--consumer", "bogus"], "--consumer of bench shuffle takes"),
    (["bench", "rechunk", "--consumer", "len"], "--consumer of bench rechunk takes a "
                                                "comma-separated list of none, sum"),
    (["bench", "shuffle", "--partitions", "10,x"], "--partitions takes"),
    (["bench", "shuffle", "--memory-limit", "lots"], "--memory-limit takes a size"),
    (["bench", "replicated", "--cases", "bogus"], "--cases takes a comma-separated list "
                                                  "of calls, scaling"),
])
def test_bad_arguments_are_refused_at_once(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_python_dash_m_runs_the_command():
    done = subprocess.run([sys.executable, "-m", "dask_services", "bench", "overhead",
                           "--repeat", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--repeat must be at least 1" in done.stderr
