"""dask.dataframe wiring: the ``"service"`` shuffle method.

dask-expr lowers every hash shuffle (``shuffle``, ``set_index``, ``sort_values``, hash
``merge``/``join``, ``groupby`` with ``split_out``/``apply``, ``drop_duplicates``) to a
``Shuffle`` expression, whose ``_lower`` picks an implementation by method name and refuses
unknown names.  Importing ``dask_services`` wraps ``Shuffle._lower`` so that the name
``"service"`` lowers to :class:`ServiceShuffle`; every other name goes to dask unchanged.
A merge picks a broadcast join (``broadcast=True``, or a few partitions joined with many)
only for the methods dask names there; ``Merge.is_broadcast_join`` is wrapped so that
``"service"`` decides as ``"tasks"`` and ``"p2p"`` do (without it ``broadcast=True`` was
ignored and both sides shuffled).  ``tests/test_dataframe_hooks.py`` fails loudly if a
dask upgrade moves these hooks.
"""

from __future__ import annotations

import functools
from typing import Any

import pandas as pd
from dask._task_spec import Alias, TaskRef
from dask.dataframe.dask_expr._expr import Blockwise, Expr, Fused
from dask.dataframe.dask_expr._merge import Merge
from dask.dataframe.dask_expr._shuffle import AssignPartitioningIndex, Shuffle, SimpleShuffle
from dask.dataframe.dask_expr.io import FromGraph
from dask.tokenize import tokenize
from dask.typing import Key
from dask.utils import get_default_shuffle_method

from dask_services._exchange import graph_settings
from dask_services.graph import (
    HandOffSpec,
    ServiceDefinition,
    ServiceKeyOfHandOff,
    _hand_off,
    build_service_graph,
    service_key_of_handoffs,
)

METHOD = "service"
SERVICE_PREFIX = "shuffle-service"  # the service tasks' keys: f"{SERVICE_PREFIX}-{token}"


class ShuffleHandOffs(Blockwise):
    """The hand-offs of a service shuffle's input partitions, one per partition.

    A blockwise step, so that dask fuses it with the blockwise steps making its input (a
    read, a conversion, a ``map_partitions``): the partition is made and handed off in one
    task, and never held by a task of its own.  Where nothing fuses (a persisted input),
    each is a hand-off task on the worker's event loop.  ``frame``'s keys are the
    service's input keys; ``shuffle`` is the token of the shuffle it belongs to.

    The service task's key is derived from the hand-offs' task name
    (``graph.service_key_of_handoffs``), which differs between a fused and an unfused graph of
    the same shuffle: the two are different graphs, and a scheduler still holding one must
    not see the other under the same key.
    """

    _parameters = ["frame", "shuffle"]

    @functools.cached_property
    def _meta(self):
        return self.frame._meta

    def _divisions(self):
        return self.frame.divisions

    def input_key(self, index: int) -> Key:
        """The key the hand-off ``index`` takes: a persisted collection's own key (dask
        gives it an alias task per partition, a scheduler round trip each), else the
        frame's."""
        if isinstance(self.frame, FromGraph):
            return self.frame.operand("keys")[index]
        return (self.frame._name, index)

    def _task(self, name: Key, index: int) -> HandOffSpec:
        input_key = self.input_key(index)
        service = ServiceKeyOfHandOff(SERVICE_PREFIX)
        return HandOffSpec(name, _hand_off, name, service, input_key, TaskRef(input_key))


def handoffs_of(frame: Expr) -> ShuffleHandOffs:
    """The hand-offs expression ``frame`` is, or is fused into."""
    if isinstance(frame, Fused) and isinstance(frame.exprs[0], ShuffleHandOffs):
        return frame.exprs[0]
    if not isinstance(frame, ShuffleHandOffs):
        raise TypeError(
            f"a service shuffle's input must be its hand-offs, not {type(frame).__name__}; "
            "was the expression rewritten after lowering?"
        )
    return frame


class ServiceShuffle(SimpleShuffle):
    """A hash shuffle carried out by one :class:`DataFrameShuffle` service task.

    ``frame`` is a :class:`ShuffleHandOffs` of the partitions to shuffle (or what dask fused
    it into).

    ``assign`` folds dask's ``AssignPartitioningIndex`` into the shuffle: when set, the
    input is that expression's input and every instance computes each row's target
    partition itself (``_partitioning.target_partitions``: the numbers dask's step gives),
    instead of a task per input partition doing it.

    ``settings``: those of ``_exchange.graph_settings``, taken where the shuffle was
    lowered (the client), for its service task's parameters.
    """

    _parameters = [*SimpleShuffle._parameters, "assign", "settings"]
    _defaults = {**SimpleShuffle._defaults, "assign": None, "settings": None}
    runs_service_tasks = True  # the client sending it installs dask_services (_auto_install)

    @functools.cached_property
    def _meta(self):
        if self.operand("assign") is not None:
            meta = self.frame._meta
            meta = meta.to_frame() if meta.ndim == 1 else meta
        else:
            meta = self.frame._meta.drop(columns=self.partitioning_index)
        # the outputs are assembled with ``ignore_index`` (``DataFrameShuffle``)
        return meta.reset_index(drop=True) if self.ignore_index else meta

    def _simplify_up(self, parent, dependents):
        # Projections and filters were pushed below the shuffle before it was lowered; a
        # projection pushed now would come between the hand-offs and their service task.
        return None

    def substitute_parameters(self, substitutions: dict) -> Expr:
        """Selecting partitions (``Partitions``, ``head``) makes a service task of its own,
        with hand-offs of its own: two selections of one shuffle may be computed at once,
        and each service task produces only its outputs."""
        if ("_partitions" in substitutions
                and substitutions["_partitions"] != self.operand("_partitions")):
            handoffs = handoffs_of(self.frame)
            token = tokenize(handoffs.operand("shuffle"), substitutions["_partitions"])
            substitutions = {**substitutions, "frame": ShuffleHandOffs(handoffs.frame, token)}
        return super().substitute_parameters(substitutions)

    def _layer(self) -> dict:
        from dask_services.dataframe._service import DataFrameShuffle

        handoffs = handoffs_of(self.frame)
        service_key = service_key_of_handoffs(SERVICE_PREFIX, self.frame._name)
        selected = list(self._partitions) if self._filtered else list(
            range(self.npartitions_out)
        )
        # a partition selected twice (``partitions[[1, 1]]``) is produced once; its other
        # places are aliases of the first
        first: dict[int, int] = {}
        for i, p in enumerate(selected):
            first.setdefault(p, i)
        parts_out = list(first)
        input_keys = [handoffs.input_key(i) for i in range(self.frame.npartitions)]
        definition = ServiceDefinition(
            service_class=DataFrameShuffle,
            params={
                "meta": self._meta,
                "column": self.partitioning_index,
                "assign": self.operand("assign"),
                "parts_out": parts_out,
                "input_index": {k: i for i, k in enumerate(input_keys)},
                "ignore_index": bool(self.ignore_index),
                # set where the graph was lowered (the client), not where it is
                # materialized (the scheduler)
                **(self.operand("settings") or {}),
            },
            input_keys=tuple(input_keys),
            handoff_keys=tuple((self.frame._name, i) for i in range(len(input_keys))),
            output_keys=tuple((self._name, first[p]) for p in parts_out),
            # every shuffle into N partitions puts partition i on the same worker, so the
            # two sides of a hash join meet without moving data again
            placement=f"dataframe-shuffle-{self.npartitions_out}",
            name="shuffle",
            # a worker holding no partition and owning no output (a small table on a large
            # cluster) has no instance: no start, no barrier reply
            participants="involved",
        )
        graph = build_service_graph(definition, service_key, input_keys, handoffs_given=True)
        for i, p in enumerate(selected):
            if first[p] != i:
                graph[(self._name, i)] = Alias((self._name, i), (self._name, first[p]))
        return graph


_dask_lower = Shuffle._lower


def refuse_multiindex_columns(meta: Any) -> None:
    """``NotImplementedError`` for a frame with ``MultiIndex`` columns: dask's shuffle
    adds its partition column as a tuple the frame's later steps cannot drop."""
    if isinstance(getattr(meta, "columns", None), pd.MultiIndex):
        raise NotImplementedError(
            "MultiIndex columns are not supported by the service shuffle; flatten them "
            "first, e.g. df.columns = ['_'.join(map(str, c)) for c in df.columns]"
        )


def _lower(self: Shuffle):
    method = self.method or get_default_shuffle_method()
    if method == METHOD:
        refuse_multiindex_columns(self.frame._meta)
        from dask_services._auto_install import note_service_graph
        from dask_services._config_check import check_config
        from dask_services.client import _maybe_install_default_client

        check_config()
        note_service_graph()
        _maybe_install_default_client()
        frame, assign = self.frame, None
        if (isinstance(frame, AssignPartitioningIndex)
                and frame.operand("index_name") == self.partitioning_index
                and not isinstance(frame.operand("partitioning_index"), Expr)):
            assign = (
                frame.operand("partitioning_index"),
                frame.operand("index_name"),
                frame.operand("npartitions_out"),
                frame.operand("meta"),
                frame.operand("index_shuffle"),
            )
            frame = frame.frame
        operands = (self.partitioning_index, self.npartitions_out, drops_index(self),
                    self.options, self.original_partitioning_index, None, assign,
                    graph_settings("shuffle"))
        return ServiceShuffle(ShuffleHandOffs(frame, tokenize(frame._name, *operands)),
                              *operands)
    return _dask_lower(self)


def drops_index(shuffle: Shuffle) -> bool:
    """Whether the outputs of ``shuffle`` drop their index: only where dask's meta of the
    shuffle does.

    ``ignore_index=True`` allows a shuffle to drop the index, and dask's meta of a shuffle
    (``ShuffleBase._meta``) only drops it for the ``tasks`` method (``p2p`` and ``disk`` keep
    it).  The collection a user holds has that meta, so the service's partitions must have
    its index too: dropping it whenever ``ignore_index`` was set gave a result whose index
    (unnamed, integer) disagreed with the meta's (``df.shuffle(on, ignore_index=True)``).
    """
    if not shuffle.ignore_index:
        return False
    meta, before = shuffle._meta, shuffle.frame._meta
    if meta is before:
        return False
    return not (type(meta.index) is type(before.index)
                and list(meta.index.names) == list(before.index.names)
                and meta.index.dtype == before.index.dtype)


_lower.__wrapped__ = _dask_lower  # type: ignore[attr-defined]

_dask_is_broadcast_join = Merge.__dict__["is_broadcast_join"]


def _is_broadcast_join(self: Merge) -> bool:
    """dask's choice of a broadcast join, with ``"service"`` deciding as ``"tasks"``."""
    if ("shuffle_method" in self._parameters
            and (self.shuffle_method or get_default_shuffle_method()) == METHOD):
        return self.substitute_parameters({"shuffle_method": "tasks"}).is_broadcast_join
    return _dask_is_broadcast_join.func(self)  # also a lowered join's, as before


_broadcast_join_choice = functools.cached_property(_is_broadcast_join)


def register() -> None:
    """Make ``"service"`` a shuffle method of dask.dataframe (idempotent)."""
    from dask_services.dataframe import _compute_fusion

    if Shuffle._lower is not _lower:
        Shuffle._lower = _lower
    if Merge.__dict__["is_broadcast_join"] is not _broadcast_join_choice:
        Merge.is_broadcast_join = _broadcast_join_choice
        _broadcast_join_choice.__set_name__(Merge, "is_broadcast_join")
    _compute_fusion.install()
