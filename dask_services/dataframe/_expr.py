"""dask.dataframe wiring: the ``"service"`` shuffle method.

dask-expr lowers every hash shuffle (``shuffle``, ``set_index``, ``sort_values``, hash
``merge``/``join``, ``groupby`` with ``split_out``/``apply``, ``drop_duplicates``) to a
``Shuffle`` expression, whose ``_lower`` picks an implementation by method name and refuses
unknown names.  Importing ``dask_services`` wraps ``Shuffle._lower`` so that the name
``"service"`` lowers to :class:`ServiceShuffle`; every other name goes to dask unchanged.
``tests/test_dataframe_hooks.py`` fails loudly if a dask upgrade moves this hook.
"""

from __future__ import annotations

import functools

from dask.dataframe.dask_expr._expr import Expr
from dask.dataframe.dask_expr._shuffle import AssignPartitioningIndex, Shuffle, SimpleShuffle
from dask.utils import get_default_shuffle_method

from dask_services.graph import ServiceDefinition, build_service_graph

METHOD = "service"


class ServiceShuffle(SimpleShuffle):
    """A hash shuffle carried out by one :class:`DataFrameShuffle` service task.

    ``assign`` folds dask's ``AssignPartitioningIndex`` into the shuffle: when set, ``frame``
    is that expression's input and every instance computes each row's target partition
    itself (``_partitioning.target_partitions``: the numbers dask's step gives), instead of
    a task per input partition doing it.
    """

    _parameters = [*SimpleShuffle._parameters, "assign"]
    _defaults = {**SimpleShuffle._defaults, "assign": None}

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
        if self.operand("assign") is not None:
            # ``frame`` lacks the partitioning column; projections and filters were
            # pushed down before lowering already
            return None
        return super()._simplify_up(parent, dependents)

    def _layer(self) -> dict:
        from dask_services.dataframe._service import DataFrameShuffle

        token = self._name.split("-")[-1]
        parts_out = list(self._partitions) if self._filtered else list(
            range(self.npartitions_out)
        )
        input_keys = [(self.frame._name, i) for i in range(self.frame.npartitions)]
        definition = ServiceDefinition(
            service_class=DataFrameShuffle,
            params={
                "meta": self._meta,
                "column": self.partitioning_index,
                "assign": self.operand("assign"),
                "parts_out": parts_out,
                "input_index": {k: k[1] for k in input_keys},
                "ignore_index": bool(self.ignore_index),
            },
            input_keys=tuple(input_keys),
            handoff_keys=tuple((f"shuffle-handoff-{token}", i) for i in range(len(input_keys))),
            output_keys=tuple((self._name, i) for i in range(len(parts_out))),
            # every shuffle into N partitions puts partition i on the same worker, so the
            # two sides of a hash join meet without moving data again
            placement=f"dataframe-shuffle-{self.npartitions_out}",
            name="shuffle",
        )
        return build_service_graph(definition, f"shuffle-service-{token}", input_keys)


_dask_lower = Shuffle._lower


def _lower(self: Shuffle):
    method = self.method or get_default_shuffle_method()
    if method == METHOD:
        from dask_services.client import _maybe_install_default_client

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
        return ServiceShuffle(
            frame,
            self.partitioning_index,
            self.npartitions_out,
            drops_index(self),
            self.options,
            self.original_partitioning_index,
            None,
            assign,
        )
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


def register() -> None:
    """Make ``"service"`` a shuffle method of dask.dataframe (idempotent)."""
    if Shuffle._lower is not _lower:
        Shuffle._lower = _lower
