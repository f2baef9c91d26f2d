"""Example services that show the framework is general."""

from dask_services.examples.allreduce import AllReduce
from dask_services.examples.sample_sort import SampleSort

__all__ = ["AllReduce", "SampleSort"]
