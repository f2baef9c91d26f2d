"""The worker's ``dask-services`` directory: there only while something is in it.

Instances take a directory of their own in it, and outputs held while a worker is paused
are written to it.  It is made when the first of those is, and removed with the last, so a
worker's local directory looks as it did before a run once the run is over (as p2p leaves
it).  It is shared by the event loop (instances) and service threads (outputs written to
disk): whatever makes something in it makes the directory again if another thread removed
it meanwhile.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
NAME = "dask-services"


def directory_in(base: str | None) -> str:
    """The path of the ``dask-services`` directory in ``base`` (not made yet)."""
    return os.path.join(base or tempfile.gettempdir(), NAME)


def in_directory(directory: str, make: Callable[[], T], attempts: int = 3) -> T:
    """``make()``, which makes something in ``directory``, that directory made first where
    missing, and again where it went away before ``make`` ran."""
    for _ in range(attempts - 1):
        os.makedirs(directory, exist_ok=True)
        try:
            return make()
        except FileNotFoundError:
            continue
    os.makedirs(directory, exist_ok=True)
    return make()


def remove_if_empty(directory: str) -> None:
    """Remove ``directory`` if nothing is left in it."""
    try:
        os.rmdir(directory)
    except OSError:  # not empty, or gone already
        pass
