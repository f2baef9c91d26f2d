"""A service task's runs as data: phases, the live :class:`Run` the machine changes, the
immutable :class:`RunSnapshot` actions carry, and stimulus ids (distributed's style)."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from dask.typing import Key

from dask_services.service import ServiceId

_stimuli = itertools.count(1)


def new_stimulus_id(name: str) -> str:
    """A fresh stimulus id, ``<name>-<time>-<n>`` (distributed's style, made unique)."""
    return f"{name}-{time.time()}-{next(_stimuli)}"


def stimulus_field(name: str) -> Any:
    """A dataclass field defaulting to a fresh stimulus id named ``name``."""
    return field(default_factory=lambda: new_stimulus_id(name), kw_only=True)


class Phase(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    INPUTS_DONE = "inputs-done"
    FINISHED = "finished"
    FAILED = "failed"


LIVE_PHASES = frozenset({Phase.STARTING, Phase.RUNNING, Phase.INPUTS_DONE})


@dataclass(frozen=True)
class RunSnapshot:
    """An immutable view of a :class:`Run` at one moment: what actions, status rows and
    observers get."""

    run_id: int
    participants: tuple[str, ...]
    ids: Mapping[str, ServiceId]  # read-only
    wanted: tuple[Key, ...]
    owners: Mapping[Key, ServiceId]  # read-only
    leader: ServiceId
    phase: Phase
    instances_started: int
    inputs_handed_off: int
    outputs_produced: int
    outputs_landed: int

    @property
    def outputs_wanted(self) -> int:
        return len(self.wanted)

    @property
    def live(self) -> bool:
        return self.phase in LIVE_PHASES


@dataclass
class Run:
    """One attempt at a service task; owned and changed by its machine only."""

    run_id: int
    participants: tuple[str, ...]  # worker addresses, in placement order
    ids: dict[str, ServiceId]  # worker address -> instance id
    wanted: tuple[Key, ...]
    owners: dict[Key, ServiceId]
    leader: ServiceId
    phase: Phase = Phase.STARTING
    started: set[ServiceId] = field(default_factory=set)
    handed_off: set[Key] = field(default_factory=set)
    taken_by: dict[Key, ServiceId] = field(default_factory=dict)  # input -> its instance
    produced: dict[Key, str] = field(default_factory=dict)
    landed: set[Key] = field(default_factory=set)  # produced and in memory (or gone)
    # instances whose ``all_inputs_done`` returned (without failing)
    returned: set[ServiceId] = field(default_factory=set)
    concluded: bool = False

    def __post_init__(self) -> None:
        # membership tests once per event: a tuple would make a run quadratic in its outputs
        self.wanted_set = frozenset(self.wanted)
        # never change after creation: shared, read-only, by every snapshot
        self._ids_view = MappingProxyType(dict(self.ids))
        self._owners_view = MappingProxyType(dict(self.owners))

    @property
    def live(self) -> bool:
        return self.phase in LIVE_PHASES

    @property
    def worker_of(self) -> dict[ServiceId, str]:
        return {sid: w for w, sid in self.ids.items()}

    # the figures of a snapshot, read off the live run
    @property
    def instances_started(self) -> int:
        return len(self.started)

    @property
    def inputs_handed_off(self) -> int:
        return len(self.handed_off)

    @property
    def outputs_wanted(self) -> int:
        return len(self.wanted)

    @property
    def outputs_produced(self) -> int:
        return len(self.produced)

    @property
    def outputs_landed(self) -> int:
        return len(self.landed)

    def snapshot(self) -> RunSnapshot:
        return RunSnapshot(
            run_id=self.run_id, participants=self.participants, ids=self._ids_view,
            wanted=self.wanted, owners=self._owners_view, leader=self.leader,
            phase=self.phase, instances_started=len(self.started),
            inputs_handed_off=len(self.handed_off), outputs_produced=len(self.produced),
            outputs_landed=len(self.landed),
        )
