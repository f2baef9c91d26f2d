from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from services import Recorder  # noqa: E402


@pytest.fixture(autouse=True)
def _reset_recorder():
    Recorder.reset()
    yield
    Recorder.reset()
