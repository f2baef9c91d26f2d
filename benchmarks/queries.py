"""Decision-support queries: chains of merges, filters and groupby aggregations.

    dask-services bench queries [--scale 1] [--repeat 3] [--methods service,p2p,tasks]

Six queries in the style of a decision-support benchmark, over generated tables (a
``lineitem`` fact table, ``orders``, ``customer``, ``part``, and small ``supplier`` and
``nation`` tables), each run with ``dataframe.shuffle.method`` set to every method in
turn on one cluster (warm workers, tables persisted first; methods rotate between
repeats).  Every result is checked against the ``tasks`` result before it is timed.

At ``--scale 1``: lineitem 2,000,000 rows in 40 partitions, orders 500,000 in 20,
customer 50,000 in 8, part 100,000 in 10, supplier 5,000 in 1, nation 25 in 1: tens of
partitions per table, some tables small, as the joins users write meet them.  The report
gives each query's median time against ``p2p`` and ``tasks``, and a ``total`` row (the
sum of the medians).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from benchmarks.common import Measurement, progress, rotated, timed

DAYS = 2_400  # order dates are days since the start of the period


def _lineitem(i: int, rows: int, orders: int, parts: int, suppliers: int) -> pd.DataFrame:
    rng = np.random.default_rng(1_000 + i)
    return pd.DataFrame({
        "l_orderkey": rng.integers(0, orders, rows),
        "l_partkey": rng.integers(0, parts, rows),
        "l_suppkey": rng.integers(0, suppliers, rows),
        "l_quantity": rng.integers(1, 51, rows).astype("float64"),
        "l_extendedprice": rng.random(rows) * 1e4,
        "l_discount": rng.integers(0, 11, rows) / 100,
        "l_returnflag": pd.array(rng.choice(["A", "N", "R"], rows), dtype="str"),
        "l_shipmode": pd.array(rng.choice(["AIR", "MAIL", "RAIL", "SHIP", "TRUCK"], rows),
                               dtype="str"),
        "l_shipdate": rng.integers(0, DAYS + 120, rows),
    })


def _orders(i: int, rows: int, customers: int) -> pd.DataFrame:
    rng = np.random.default_rng(2_000 + i)
    return pd.DataFrame({
        "o_orderkey": np.arange(i * rows, (i + 1) * rows),
        "o_custkey": rng.integers(0, customers, rows),
        "o_orderdate": rng.integers(0, DAYS, rows),
        "o_orderpriority": pd.array(rng.choice(["1-URGENT", "2-HIGH", "3-MEDIUM", "4-LOW"],
                                               rows), dtype="str"),
        "o_shippriority": rng.integers(0, 2, rows),
    })


def _customer(i: int, rows: int) -> pd.DataFrame:
    rng = np.random.default_rng(3_000 + i)
    return pd.DataFrame({
        "c_custkey": np.arange(i * rows, (i + 1) * rows),
        "c_nationkey": rng.integers(0, 25, rows),
        "c_mktsegment": pd.array(rng.choice(["AUTOMOBILE", "BUILDING", "FURNITURE",
                                             "HOUSEHOLD", "MACHINERY"], rows), dtype="str"),
        "c_acctbal": rng.random(rows) * 1e4,
    })


def _part(i: int, rows: int) -> pd.DataFrame:
    rng = np.random.default_rng(4_000 + i)
    return pd.DataFrame({
        "p_partkey": np.arange(i * rows, (i + 1) * rows),
        "p_brand": pd.array([f"Brand#{b}" for b in rng.integers(10, 56, rows)], dtype="str"),
        "p_size": rng.integers(1, 51, rows),
    })


def tables(scale: float = 1.0) -> dict[str, Any]:
    """The generated tables as dask DataFrames (not persisted)."""
    import dask.dataframe as dd

    def n(rows: int) -> int:
        return max(int(rows * scale), 1)

    counts = {"lineitem": (n(2_000_000), 40), "orders": (n(500_000), 20),
              "customer": (n(50_000), 8), "part": (n(100_000), 10)}
    per = {name: rows // parts for name, (rows, parts) in counts.items()}
    orders = per["orders"] * 20
    customers = per["customer"] * 8
    parts = per["part"] * 10
    suppliers = n(5_000)
    rng = np.random.default_rng(5_000)
    supplier = pd.DataFrame({"s_suppkey": np.arange(suppliers),
                             "s_nationkey": rng.integers(0, 25, suppliers)})
    nation = pd.DataFrame({
        "n_nationkey": np.arange(25), "n_regionkey": np.arange(25) % 5,
        "n_name": pd.array([f"NATION{k:02d}" for k in range(25)], dtype="str"),
    })
    return {
        "lineitem": dd.from_map(_lineitem, range(40), rows=per["lineitem"], orders=orders,
                                parts=parts, suppliers=suppliers),
        "orders": dd.from_map(_orders, range(20), rows=per["orders"], customers=customers),
        "customer": dd.from_map(_customer, range(8), rows=per["customer"]),
        "part": dd.from_map(_part, range(10), rows=per["part"]),
        "supplier": dd.from_pandas(supplier, npartitions=1),
        "nation": dd.from_pandas(nation, npartitions=1),
    }


def _revenue(df: Any) -> Any:
    return df.l_extendedprice * (1 - df.l_discount)


def q3(t: dict[str, Any]) -> Any:
    """Unshipped orders of one market segment: customer x orders x lineitem, top revenue."""
    c = t["customer"][t["customer"].c_mktsegment == "BUILDING"]
    o = t["orders"][t["orders"].o_orderdate < 1_200]
    li = t["lineitem"][t["lineitem"].l_shipdate > 1_200]
    j = c.merge(o, left_on="c_custkey", right_on="o_custkey")
    j = j.merge(li, left_on="o_orderkey", right_on="l_orderkey")
    j = j.assign(revenue=_revenue(j))
    g = j.groupby(["l_orderkey", "o_orderdate", "o_shippriority"]).revenue.sum(split_out=4)
    return g.reset_index().nlargest(10, "revenue")


def q5(t: dict[str, Any]) -> Any:
    """Revenue per nation through suppliers of the customer's own nation: five tables."""
    o = t["orders"][(t["orders"].o_orderdate >= 365) & (t["orders"].o_orderdate < 730)]
    j = t["customer"].merge(o, left_on="c_custkey", right_on="o_custkey")
    j = j.merge(t["lineitem"], left_on="o_orderkey", right_on="l_orderkey")
    j = j.merge(t["supplier"], left_on=["l_suppkey", "c_nationkey"],
                right_on=["s_suppkey", "s_nationkey"])
    j = j.merge(t["nation"], left_on="s_nationkey", right_on="n_nationkey")
    j = j.assign(revenue=_revenue(j))
    return j.groupby("n_name").revenue.sum().reset_index()


def q10(t: dict[str, Any]) -> Any:
    """Customers who returned items: revenue lost per customer, top 20."""
    o = t["orders"][(t["orders"].o_orderdate >= 900) & (t["orders"].o_orderdate < 990)]
    li = t["lineitem"][t["lineitem"].l_returnflag == "R"]
    j = t["customer"].merge(o, left_on="c_custkey", right_on="o_custkey")
    j = j.merge(li, left_on="o_orderkey", right_on="l_orderkey")
    j = j.merge(t["nation"], left_on="c_nationkey", right_on="n_nationkey")
    j = j.assign(revenue=_revenue(j))
    g = j.groupby(["c_custkey", "n_name"]).revenue.sum(split_out=4).reset_index()
    return g.nlargest(20, "revenue")


def q12(t: dict[str, Any]) -> Any:
    """Urgent and other orders per ship mode: orders x lineitem."""
    li = t["lineitem"][t["lineitem"].l_shipmode.isin(["MAIL", "SHIP"])]
    j = t["orders"].merge(li, left_on="o_orderkey", right_on="l_orderkey")
    j = j.assign(urgent=j.o_orderpriority.isin(["1-URGENT", "2-HIGH"]).astype("int64"))
    return j.groupby("l_shipmode").urgent.agg(["sum", "count"]).reset_index()


def q18(t: dict[str, Any]) -> Any:
    """Large orders: a shuffled groupby over lineitem, filtered, joined back to orders and
    customers."""
    big = t["lineitem"].groupby("l_orderkey").l_quantity.sum(split_out=8).reset_index()
    big = big[big.l_quantity > 200]
    j = big.merge(t["orders"], left_on="l_orderkey", right_on="o_orderkey")
    j = j.merge(t["customer"], left_on="o_custkey", right_on="c_custkey")
    return j[["c_custkey", "o_orderkey", "o_orderdate", "l_quantity"]].nlargest(
        50, ["l_quantity", "o_orderkey"])


def brand_volume(t: dict[str, Any]) -> Any:
    """Quantity per brand and size: lineitem x part on a key of many values, then a
    shuffled groupby."""
    j = t["lineitem"].merge(t["part"], left_on="l_partkey", right_on="p_partkey")
    return j.groupby(["p_brand", "p_size"]).l_quantity.sum(split_out=4).reset_index()


QUERIES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "q3": q3, "q5": q5, "q10": q10, "q12": q12, "q18": q18, "brand_volume": brand_volume,
}


def canonical(result: pd.DataFrame) -> pd.DataFrame:
    """A query result in an order that does not depend on the partitioning."""
    result = result.reset_index(drop=True)
    return result.sort_values(list(result.columns)).reset_index(drop=True)


def _quiet_p2p() -> None:
    """p2p's scheduler plugin logs a warning at every start and end of a shuffle."""
    import logging

    logging.getLogger("distributed.shuffle").setLevel(logging.ERROR)


def run(client: Any, scale: float = 1.0, repeat: int = 3,
        methods: tuple[str, ...] = ("service", "p2p", "tasks"),
        queries: tuple[str, ...] = tuple(QUERIES), show_progress: bool = True,
        ) -> list[Measurement]:
    import dask

    import dask_services

    dask_services.install(client)
    client.run_on_scheduler(_quiet_p2p)
    persisted = {name: client.persist(df) for name, df in tables(scale).items()}
    client.wait_for_workers(1)
    from distributed import wait

    wait([f for df in persisted.values() for f in client.futures_of(df)])
    methods = list(methods)
    expected: dict[str, pd.DataFrame] = {}
    for name in queries:
        with dask.config.set({"dataframe.shuffle.method": "tasks"}):
            expected[name] = canonical(QUERIES[name](persisted).compute())
    results = {(q, m): Measurement(q, m) for q in queries for m in methods}
    total, done = repeat * len(methods) * len(queries), 0
    for r in range(repeat):
        for method in rotated(methods, r):
            for name in queries:
                with dask.config.set({"dataframe.shuffle.method": method}):
                    query = QUERIES[name](persisted)
                    got: list[pd.DataFrame] = []
                    seconds = timed(lambda q=query, out=got: out.append(q.compute()))
                pd.testing.assert_frame_equal(canonical(got[0]), expected[name],
                                              check_dtype=False, rtol=1e-9)
                results[(name, method)].seconds.append(seconds)
                done += 1
                progress(done, total, f"queries ({method})", show_progress)
    out = list(results.values())
    for method in methods:
        summed = Measurement("total", method)
        summed.seconds = [sum(results[(q, method)].median for q in queries)]
        out.append(summed)
    return out


def report(results: list[Measurement], as_json: bool) -> str:
    """Each query's median time against ``p2p`` and against ``tasks``."""
    import json

    rows = []
    for r in results:
        row: dict[str, Any] = {"query": r.case, "method": r.method, "median_s": r.median}
        for base in ("p2p", "tasks"):
            b = next((x for x in results if x.case == r.case and x.method == base), None)
            row[f"x_{base}"] = r.median / b.median if b else None
        rows.append(row)
    if as_json:
        return json.dumps(rows, indent=2)
    lines = ["query | method | median s | x p2p | x tasks", "--- | --- | --- | --- | ---"]
    for row in rows:
        ratios = [f"{row[k]:.2f}" if row[k] is not None else "-" for k in ("x_p2p", "x_tasks")]
        lines.append(f"{row['query']} | {row['method']} | {row['median_s']:.3f} | "
                     + " | ".join(ratios))
    return "\n".join(lines)
