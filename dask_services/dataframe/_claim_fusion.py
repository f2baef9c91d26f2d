"""A service shuffle's outputs run their only consumer in their claims.

After dask's blockwise fusion, a shuffle followed by a step per partition (a
``map_partitions``, a groupby-apply, the ``len`` of each partition) is three kinds of task:
the service task, one claim per output (which takes the produced partition into the
worker's memory) and one consumer per output.  Where the shuffle's only dependent is a
blockwise step that depends on nothing else, that step runs in the claims
(:class:`ConsumedShuffle`, ``graph.ConsumingClaimSpec``): one task per output partition
instead of two, the consumer running as soon as its partition is produced, and the
partition freed when it returns.  dask.array graphs get the same from
``dask_services._claim_fusion`` after their low-level fusion; dataframe graphs fuse as
expressions, so here it is a rewrite of the fused expression.

A key names one value: the fused service task is a new one, so its hand-offs take a new
token (which names the service task) and the consumer's partitions a new name.  Applied
after every blockwise fusion of a dataframe expression (``optimize()``, ``persist()``,
``compute()`` through ``_compute_fusion``), unless ``dask_services.fuse-consumers`` is off.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import dask
from dask._expr import collect_dependents
from dask._task_spec import TaskRef
from dask.dataframe.dask_expr import _expr as df_expr
from dask.dataframe.dask_expr._expr import Blockwise, Expr, Fused
from dask.tokenize import tokenize

from dask_services.graph import (
    Consumer,
    ConsumingClaimSpec,
    ServiceTaskSpec,
    _claim_and_consume,
)

_dask_blockwise_fusion = df_expr.optimize_blockwise_fusion


class ConsumedShuffle(Expr):
    """``consumer`` (a blockwise step whose only dependency is ``shuffle``) run in the
    claims of ``shuffle``'s outputs.  Its dependencies are the shuffle's: the hand-offs."""

    _parameters = ["shuffle", "consumer"]

    @functools.cached_property
    def _name(self) -> str:
        return f"{self.consumer._name.rsplit('-', 1)[0]}-{self.deterministic_token}"

    @functools.cached_property
    def _meta(self) -> Any:
        return self.consumer._meta

    def _divisions(self) -> tuple:
        return self.consumer._divisions()

    def dependencies(self) -> list[Expr]:
        return [self.shuffle.frame]

    def _layer(self) -> dict:
        shuffle, consumer = self.shuffle, self.consumer
        # the consumer names the shuffle before its hand-offs were renamed
        (consumed,) = (d._name for d in consumer.dependencies())
        layer = shuffle._layer()
        (service,) = (n for n in layer.values() if isinstance(n, ServiceTaskSpec))
        definition = service.definition
        consumers = {out: consumer._task((self._name, i), i)
                     for i, out in enumerate(definition.output_keys)}
        if any(task.dependencies != {(consumed, i)}
               for i, task in enumerate(consumers.values())):
            # a blockwise step reading another partition than its own: a task each
            renamed = {(consumed, i): out for i, out in enumerate(definition.output_keys)}
            return layer | {task.key: task.substitute(renamed)
                            for task in consumers.values()}
        outputs = {out: task.key for out, task in consumers.items()}
        new_definition = dataclasses.replace(
            definition,
            output_keys=tuple(outputs.values()),
            affinity=None if definition.affinity is None else {
                outputs[out]: key for out, key in definition.affinity.items()},
        )
        layer[service.key] = ServiceTaskSpec(service.key, service.func, new_definition,
                                             *service.args[1:])
        ref = TaskRef(service.key)
        for out, task in consumers.items():
            if layer.pop(out, None) is not None:
                layer[task.key] = ConsumingClaimSpec(task.key, _claim_and_consume, ref,
                                                     task.key, Consumer(task))
        return layer


def lone_consumer(shuffle: Expr, users: list[Expr]) -> Expr | None:
    """The only dependent of ``shuffle`` where it can run in the claims: a blockwise step
    of as many partitions, which depends on nothing else."""
    if len({u._name for u in users}) != 1:
        return None
    (consumer, *_) = users
    if not isinstance(consumer, Blockwise) or consumer.npartitions != shuffle.npartitions:
        return None
    if [d._name for d in consumer.dependencies()] != [shuffle._name]:
        return None
    return consumer


def with_own_handoffs(shuffle: Expr, consumer: Expr) -> Expr:
    """``shuffle`` with hand-offs of its own (a new token), so that its service task has a
    key of its own."""
    from dask_services.dataframe._expr import ShuffleHandOffs, handoffs_of

    frame = shuffle.frame
    handoffs = handoffs_of(frame)
    own = ShuffleHandOffs(handoffs.frame,
                          tokenize(handoffs.operand("shuffle"), consumer._name))
    if isinstance(frame, Fused):
        own = Fused([own, *frame.exprs[1:]], *frame.dependencies())
    return shuffle.substitute_parameters({"frame": own})


def consumers_in_claims(expr: Expr) -> Expr:
    """``expr`` (fused) with every service shuffle's lone blockwise consumer run in the
    shuffle's claims (see the module docstring)."""
    from dask_services.dataframe._expr import ServiceShuffle
    from dask_services.dataframe._service import DataFrameShuffle

    if not (dask.config.get("dask_services.fuse-consumers", True)
            and DataFrameShuffle.outputs_by_position):
        return expr
    shuffles = list(expr.find_operations(ServiceShuffle))
    if not shuffles:
        return expr
    dependents = collect_dependents(expr)
    for shuffle in shuffles:
        users = [ref() for ref in dependents.get(shuffle._name, [])]
        consumer = lone_consumer(shuffle, [u for u in users if u is not None])
        if consumer is None or len(users) != len([u for u in users if u is not None]):
            continue
        fused = ConsumedShuffle(with_own_handoffs(shuffle, consumer), consumer)
        expr = expr.substitute(consumer, fused)
    return expr


def optimize_blockwise_fusion(expr: Expr) -> Expr:
    return consumers_in_claims(_dask_blockwise_fusion(expr))


optimize_blockwise_fusion.__wrapped__ = _dask_blockwise_fusion  # type: ignore[attr-defined]


def install() -> None:
    """Make dask.dataframe's blockwise fusion run service shuffles' lone consumers in
    their claims (idempotent)."""
    if df_expr.optimize_blockwise_fusion is not optimize_blockwise_fusion:
        df_expr.optimize_blockwise_fusion = optimize_blockwise_fusion
