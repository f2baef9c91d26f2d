"""Bad ``dask_services`` config values fail early, with the key named."""

from __future__ import annotations

import dask
import dask.array as da
import dask.dataframe as dd
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

import dask_services
from dask_services._config_check import KEYS, check_config
from dask_services.examples import AllReduce

pytestmark = pytest.mark.timeout(60)


def _flat(section: dict, prefix: str = "") -> list[str]:
    keys = []
    for k, v in section.items():
        keys += _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
    return keys


def test_every_documented_key_has_a_kind_and_the_defaults_pass():
    from dask_services.config import defaults

    documented = set(_flat(defaults["dask_services"]))
    assert documented <= set(KEYS), documented - set(KEYS)
    check_config()  # the defaults


# the last of each kind let another exception than ValueError out of the check (inf or
# "1e400": OverflowError; "": IndexError; [], {}: AttributeError), or, a count above
# sys.maxsize, passed and then failed in the scheduler's plugin (the run hung)
BAD = {"count": ["x", -1, 2.5, True, "3 things", float("inf"), [], 2**63],
       "duration": ["soon", -1, "5 parsecs", True, "", "  ", [], {}, "1e400"],
       "size": ["lots", -5, True, float("inf"), "1e400", [], {}],
       "fraction": [0, 1.5, "half", -0.1, True],
       "bool": ["yes", 1, None],
       "imports": ["module", "a:b, c", ["no_colon"], [":Plugin"], ["module:"], [3], None,
                   {"a": "b"}]}


@given(st.sampled_from(sorted(KEYS)), st.data())
def test_a_bad_value_names_its_key_and_what_it_should_be(key, data):
    kind = KEYS[key][0]
    value = data.draw(st.sampled_from(BAD[kind]))
    with dask.config.set({f"dask_services.{key}": value}):
        with pytest.raises(ValueError, match=rf"dask_services\.{key}=.* is not valid: it "
                                             r"should be "):
            check_config()


@pytest.mark.parametrize("key, value", [
    ("unproduced-timeout", None), ("unproduced-timeout", False), ("threads", None),
    ("restarts", 0), ("replicated.call-retries", 0), ("hand-off-buffer", 0),
    ("stop-grace", 0), ("replicated.health-check-period", 0), ("shuffle.buffer-fraction", 1),
    ("replicated.deploy-timeout", 12),
    ("rechunk.slice-saving", "1 KiB"), ("restarts", "4"), ("threads", "2"),
    ("threads", 2.0),
])
def test_good_values_pass(key, value):
    with dask.config.set({f"dask_services.{key}": value}):
        check_config()


BAD_RESTARTS = {"dask_services.restarts": "three"}


def test_bad_config_fails_when_the_graph_is_built():
    with dask.config.set(BAD_RESTARTS):
        with pytest.raises(ValueError, match="dask_services.restarts='three'"):
            dask_services.service_task(AllReduce, [dask.delayed(1)], outputs=1)
        x = da.ones((8, 8), chunks=(1, 8))
        with pytest.raises(ValueError, match="dask_services.restarts='three'"):
            x.rechunk((8, 1), method="service")
        df = dd.from_pandas(pd.DataFrame({"a": range(20)}), npartitions=4)
        with pytest.raises(ValueError, match="dask_services.restarts='three'"):
            df.shuffle("a", shuffle_method="service").optimize()
        with pytest.raises(ValueError, match="dask_services.restarts='three'"):
            AllReduce.options(replicas=1).as_service()


@pytest.mark.parametrize("value", ["1us", 1e-6, "0.5ms"])
def test_a_period_that_zero_turns_off_is_still_refused_below_a_millisecond(value):
    """``health-check-period: 0`` turns probes off; a microsecond would probe (and watch
    calls) without pause."""
    with dask.config.set({"dask_services.replicated.health-check-period": value}):
        with pytest.raises(ValueError, match=r"at least 1 ms \(or 0, to turn it off\)"):
            check_config()
    with dask.config.set({"dask_services.replicated.health-check-period": "0s"}):
        check_config()
