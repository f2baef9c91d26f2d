"""Services and errors defined in ``__main__`` (a notebook, a script) reach the workers."""

from __future__ import annotations

import pickle

import pytest

from dask_services.worker import dumps_exception, loads_exception


def main_module_error() -> type[Exception]:
    """An exception class that plain pickle cannot find by name, as in a notebook."""
    cls = type("NotebookError", (Exception,), {"__module__": "__main__"})
    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(cls("x"))
    return cls


@pytest.mark.timeout(30)
def test_an_error_class_from_main_keeps_its_type_and_message():
    cls = main_module_error()
    exc = loads_exception(dumps_exception(cls("bad input 3")))
    assert type(exc).__name__ == "NotebookError" and isinstance(exc, Exception)
    assert str(exc) == "bad input 3"
    assert any("Raised by a service instance" in n for n in exc.__notes__), exc.__notes__


@pytest.mark.timeout(30)
def test_an_error_that_cannot_be_pickled_at_all_becomes_a_runtime_error():
    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("no")

    exc = loads_exception(dumps_exception(Unpicklable("kept message")))
    assert type(exc) is RuntimeError and "Unpicklable: kept message" in str(exc)
