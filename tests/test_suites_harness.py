"""``benchmarks/distributed_suites.py``: distributed's p2p tests made to ask for ``service``."""

from __future__ import annotations

import textwrap

import pytest

from benchmarks.distributed_suites import adapted, main

pytestmark = pytest.mark.timeout(120)


def test_the_p2p_methods_asked_for_become_service():
    source = textwrap.dedent('''
        from distributed.shuffle.tests.utils import AbstractShuffleTestPool
        y = x.rechunk((2, 2), method="p2p")
        with dask.config.set({"dataframe.shuffle.method": "p2p"}):
            out = df.shuffle("a", shuffle_method="p2p")
        assert key.startswith("rechunk-p2p")
    ''')
    assert adapted(source) == textwrap.dedent('''
        from service_suites.utils import AbstractShuffleTestPool
        y = x.rechunk((2, 2), method="service")
        with dask.config.set({"dataframe.shuffle.method": "service"}):
            out = df.shuffle("a", shuffle_method="service")
        assert key.startswith("rechunk-p2p")
    ''')


def test_a_module_runs_with_service_and_its_failures_are_listed(tmp_path, capsys):
    (tmp_path / "test_rechunk.py").write_text(textwrap.dedent('''
        import dask
        import dask.array as da
        import numpy as np

        def test_service_is_what_is_asked():
            x = da.ones((4, 4), chunks=(1, 4))
            y = x.rechunk((4, 1), method="p2p")
            assert "rechunk-service" in y.name
            np.testing.assert_array_equal(y.compute(scheduler="sync"), np.ones((4, 4)))

        def test_that_fails():
            with dask.config.set({"dataframe.shuffle.method": "p2p"}):
                assert dask.config.get("dataframe.shuffle.method") == "p2p"
    '''))
    assert main([str(tmp_path), "--modules", "test_rechunk"]) == 0
    out = capsys.readouterr().out
    assert "test_rechunk: 1 failed, 1 passed" in out
    assert "    test_that_fails" in out and "test_service_is_what_is_asked" not in out
