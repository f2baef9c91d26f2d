"""A service rechunk's graph culled to the inputs its wanted outputs need.

A service task depends on every input of its region, so dask's culling (what keeps only
the tasks needed by the keys asked for, as ``x.rechunk(...)[:5]`` asks for a few output
chunks) keeps every input of a region as soon as one of its outputs is wanted.  Where a
region is connected along an axis by chunk boundaries that do not line up (chunks of 5 to
chunks of 3), that is every input along that axis, where the wanted outputs need a few.

:class:`RechunkLayer` is the rechunk's graph layer; culled to some of a service task's
outputs, it replaces that service task by one that takes only the inputs those outputs
need.  The same holds for a small region merged by one task and cut into its outputs:
culled, the merge takes the box of inputs the wanted outputs need.  The new service task
has its own keys (a suffix on its key, its hand-offs' and its outputs'), as a fused one
does (``_claim_fusion``): a graph that wants every output of the same rechunk, live at the
same time, keeps its own service task, and no output key is claimed by two service tasks.
The output chunks keep their keys as aliases of the new outputs.  The service finds its
outputs by position in the region and receives pieces for the wanted ones only
(``Concierge.wanted_outputs``), so the region's geometry stays as it was: only the inputs,
and so the hand-offs, are fewer.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Collection, Mapping
from typing import Any

from dask._task_spec import Alias
from dask.highlevelgraph import Layer, MaterializedLayer
from dask.tokenize import tokenize
from dask.typing import Key

from dask_services._claim_fusion import renamed_key
from dask_services.graph import ServiceDefinition, build_service_graph

Index = tuple[int, ...]


class RechunkLayer(MaterializedLayer):
    """The tasks of a service rechunk, with what to cull them by.

    ``services``: service key -> its definition; ``input_name``, ``output_name``: the
    rechunked array's name and the result's; ``by_output``: per axis, for each output
    chunk index, ``[(input index, slice, offset), ...]`` (``inputs_by_output``), for the
    whole array.  ``regions`` (region merge key -> its box of input indices and its output
    indices) and ``split_region`` (``(region key, box, outputs) -> tasks``) are set where
    small regions are merged by a task each.
    """

    def __init__(self, mapping: Mapping, services: dict[Key, ServiceDefinition],
                 input_name: str, output_name: str, by_output: list,
                 annotations: Any = None) -> None:
        super().__init__(mapping, annotations=annotations)
        self.services = services
        self.input_name = input_name
        self.output_name = output_name
        self.by_output = by_output
        self.regions: dict[Key, tuple[tuple[range, ...], list[Index]]] = {}
        self.split_region: Callable[..., dict[Key, Any]] | None = None

    def takes_pieces(self, j: Index) -> bool:
        """Whether output chunk ``j`` takes a piece of an input (an empty one does not)."""
        return all(self.by_output[d][jd] for d, jd in enumerate(j))

    def needed_box(self, outputs: list[Index]) -> tuple[range, ...]:
        """Per axis, the range of input indices that the output chunks ``outputs`` (each
        taking pieces) take pieces from (the indices along an axis that a region's
        outputs need are contiguous)."""
        box = []
        for d in range(len(self.by_output)):
            needed = [i for j in outputs for i, _, _ in self.by_output[d][j[d]]]
            box.append(range(min(needed), max(needed) + 1))
        return tuple(box)

    def culled_to(self, wanted: list[Index], outputs: int) -> bool:
        """Whether a region or service task of ``outputs`` output chunks is culled to the
        ``wanted`` ones: some, not all, and all taking pieces of inputs (an empty output
        chunk is left to the task as it was)."""
        return 0 < len(wanted) < outputs and all(map(self.takes_pieces, wanted))

    def needed_inputs(self, outputs: Collection[Key]) -> set[Key]:
        """The input keys the output chunks ``outputs`` (keys ``(name, *j)``) take pieces
        from."""
        needed: set[Key] = set()
        for out in outputs:
            j = out[1:]
            per_axis = [[i for i, _, _ in self.by_output[d][jd]] for d, jd in enumerate(j)]
            needed.update((self.input_name, *i) for i in itertools.product(*per_axis))
        return needed

    def cull(self, keys: set[Key], all_hlg_keys: Collection[Key]
             ) -> tuple[Layer, Mapping[Key, set[Key]]]:
        replaced: dict[Key, Any] = {}
        for service_key, definition in self.services.items():
            wanted = [out for out in definition.output_keys if out in keys]
            if not self.culled_to([out[1:] for out in wanted], len(definition.output_keys)):
                continue
            needed = self.needed_inputs(wanted)
            if len(needed) < len(definition.input_keys):
                replaced.update(with_inputs(service_key, definition, wanted, needed))
        for region_key, (box, outputs) in self.regions.items():
            wanted_outputs = [j for j in outputs if (self.output_name, *j) in keys]
            if not self.culled_to(wanted_outputs, len(outputs)):
                continue
            needed_box = self.needed_box(wanted_outputs)
            if needed_box != box:
                assert self.split_region is not None
                replaced.update(self.split_region(
                    renamed_key(region_key, tokenize(needed_box)), needed_box, wanted_outputs))
        mapping = {**self.mapping, **replaced} if replaced else self.mapping
        # only this layer's keys: dask's culling keeps a whole layer when it is asked for
        # as many keys as the layer has, and ``keys`` holds other layers' keys too
        own = {key for key in keys if key in mapping}
        culled, deps = MaterializedLayer(mapping, annotations=self.annotations).cull(
            own, all_hlg_keys)
        # the keys of other layers each task needs: dask's culling of a whole graph adds
        # these to the keys it asks the layers below for, and took this layer's own keys
        # there too (to the same effect on the layer of the inputs)
        return culled, {key: {d for d in needs if d not in culled}
                        for key, needs in deps.items()}


def with_inputs(service_key: Key, definition: ServiceDefinition, wanted: list[Key],
                needed: set[Key]) -> dict[Key, Any]:
    """The tasks of a service task like ``service_key`` that takes only the inputs
    ``needed`` (those the outputs ``wanted`` need), under new keys, and the ``wanted``
    output keys as aliases of its outputs."""
    kept = [n for n, key in enumerate(definition.input_keys) if key in needed]
    suffix = tokenize(service_key, kept)
    outputs = {out: renamed_key(out, suffix) for out in definition.output_keys}
    input_keys = tuple(definition.input_keys[n] for n in kept)
    culled = dataclasses.replace(
        definition,
        input_keys=input_keys,
        handoff_keys=tuple(renamed_key(definition.handoff_keys[n], suffix) for n in kept),
        output_keys=tuple(outputs.values()),
        wanted_outputs=tuple(outputs[out] for out in wanted),
        affinity=None if definition.affinity is None else {
            outputs[out]: key for out, key in definition.affinity.items()
            if key in needed},
    )
    tasks: dict[Key, Any] = build_service_graph(culled, renamed_key(service_key, suffix),
                                                input_keys)
    for out in wanted:
        tasks[out] = Alias(out, outputs[out])
    return tasks
