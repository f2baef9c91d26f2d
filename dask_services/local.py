"""Running a service task in-process, under dask's local schedulers.

Without a cluster, the service task's own function runs every instance of the run in this
process: same hooks, same concierge, same peer handles (loopback), on a private event loop
in a helper thread so that it works from inside Jupyter's running loop too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import tempfile
from collections.abc import Callable
from typing import Any, TypeVar

import dask.system
from dask.typing import Key

from dask_services._host import Environment, InstanceSpec, ServiceHost, stop_grace
from dask_services._memory_share import memory_to_plan_on
from dask_services._run_placement import owned_as_the_service_says
from dask_services._threads import kept_until_done
from dask_services.config import setting
from dask_services.graph import ServiceDefinition
from dask_services.service import ServiceId, TooManyRestarts

T = TypeVar("T")
LOCAL_ADDRESS = "inproc://dask-services"


class _Restart(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason


class LocalEnvironment(Environment):
    def __init__(self, directory: str) -> None:
        self.address = LOCAL_ADDRESS
        self.local_directory = directory
        self.memory_limit = None
        self.memory_to_plan_on = memory_to_plan_on(None, dask.system.CPU_COUNT)  # the process
        self.outputs: dict[Key, Any] = {}
        self.started_ids: set[ServiceId] = set()
        self.outcome: asyncio.Future = asyncio.get_running_loop().create_future()
        self.executor = concurrent.futures.ThreadPoolExecutor(1)

    def _conclude(self, exc: BaseException) -> None:
        if not self.outcome.done():
            self.outcome.set_exception(exc)

    def started(self, spec: InstanceSpec) -> None:
        self.started_ids.add(spec.id)

    def failed(self, spec: InstanceSpec, exc: BaseException) -> None:
        self._conclude(exc)

    def restart(self, spec: InstanceSpec, reason: str) -> None:
        self._conclude(_Restart(reason))

    def produced(self, spec: InstanceSpec, key: Key, value: Any) -> None:
        if key in self.outputs:
            from dask_services.service import ProduceKeyError

            self._conclude(ProduceKeyError(f"output {key!r} was produced twice"))
            return
        self.outputs[key] = value
        if len(self.outputs) == len(spec.wanted) and not self.outcome.done():
            self.outcome.set_result(None)

    async def send_rpc(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover
        raise AssertionError("in-process runs only make loopback calls")

    def run_in_executor(self, fn: Callable[..., T], *args: Any,
                        jobs: set[concurrent.futures.Future[Any]] | None = None
                        ) -> asyncio.Future[T]:
        return kept_until_done(self.executor.submit(fn, *args), jobs)


async def _one_run(definition: ServiceDefinition, service_key: Key, inputs: dict,
                   run_id: int, n_instances: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="dask-services-") as directory:
        env = LocalEnvironment(directory)
        host = ServiceHost(env)
        ids = [ServiceId(f"local-{run_id}.{i}") for i in range(n_instances)]
        wanted = tuple(definition.output_keys if definition.wanted_outputs is None
                       else definition.wanted_outputs)
        # as on a cluster: the service's own layout where it has one, else round robin
        laid_out = owned_as_the_service_says(definition, ids)
        owners = {k: laid_out[k] if laid_out is not None else ids[i % len(ids)]
                  for i, k in enumerate(wanted)}
        instances = []
        for sid in ids:
            spec = InstanceSpec(
                service_key=service_key, run_id=run_id, id=sid,
                peers={p: LOCAL_ADDRESS for p in ids},
                input_keys=definition.input_keys, output_keys=definition.output_keys,
                wanted=wanted, owners=owners, leader=ids[0],
                service_class=definition.service_class, params=definition.params,
            )
            instances.append(host.create(spec))
        try:
            await asyncio.gather(*(host.start(i) for i in instances))

            async def drive() -> None:
                if len(env.started_ids) < len(ids):
                    return  # a start() failed; the outcome says why
                await asyncio.gather(*(host.all_started(sid) for sid in ids))
                await asyncio.gather(*(
                    host.add_key(ids[j % len(ids)], key, inputs[key])
                    for j, key in enumerate(definition.input_keys)
                ))
                await asyncio.gather(*(host.all_inputs_done(sid) for sid in ids))
                # Every hook returned. The run owns this event loop: once nothing else of
                # it is left to run, an output not produced never will be (its claim raises
                # OutputLostError) instead of waiting forever.
                while not env.outcome.done():
                    others = asyncio.all_tasks() - {asyncio.current_task(), run}
                    if not others:
                        env.outcome.set_result(None)
                        break
                    await asyncio.wait(others | {env.outcome},
                                       return_when=asyncio.FIRST_COMPLETED)

            run = asyncio.current_task()
            driver = asyncio.ensure_future(drive())
            try:
                await env.outcome
            finally:
                driver.cancel()
                # a hook ignoring its cancellation keeps the driver: stop_all() lets it go
                await asyncio.wait({driver}, timeout=stop_grace())
                if driver.done() and not driver.cancelled():
                    driver.exception()  # retrieved: the outcome says what happened
            return env.outputs
        finally:
            await host.stop_all()
            env.executor.shutdown(wait=True)


def run_in_process(definition: ServiceDefinition, service_key: Key, inputs: dict) -> dict:
    """Carry out a service task in this process; returns ``{output key: value}``."""
    n_instances = max(1, int(setting("local-instances")))
    max_restarts = int(setting("restarts"))
    reason = ""
    for attempt in range(max_restarts + 1):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(
                _run_on_own_loop, _one_run(definition, service_key, inputs, attempt, n_instances)
            )
            try:
                return future.result()
            except _Restart as r:
                reason = r.reason
    raise TooManyRestarts(
        f"service task {service_key!r} was restarted {max_restarts} times and needed one "
        f"more, more than dask_services.restarts={max_restarts} allows; the last restart "
        f"was needed because {reason}"
    )


def _run_on_own_loop(coro: Any) -> Any:
    """``asyncio.run``, except that the tasks left when ``coro`` returns get
    ``dask_services.stop-grace`` to end once cancelled: a service's task that catches its
    own cancellation is left behind (``ServiceHost.stop`` warned about its hooks) instead
    of hanging the computation."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                done, _ = loop.run_until_complete(asyncio.wait(left, timeout=stop_grace()))
                for task in done:
                    if not task.cancelled():
                        task.exception()  # retrieved: the run's outcome is already known
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()
