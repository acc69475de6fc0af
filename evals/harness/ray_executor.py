"""The ``ray`` executor: each evaluation item is a Ray task; its result comes back to the driver.

What runs where (docs: the README's "Past one machine" section):

* the **driver** (``closedloop eval ... --executor ray``) plans the items, keeps at most
  ``concurrency`` tasks in flight, awaits each task's result and writes it to the one run store,
  serialised and transactional, exactly as the local executor does (the store is never opened on
  a worker);
* a **task** runs one item: a module-level function of a picklable payload, on a Ray worker
  process holding the item's resource request (``num_cpus``, ``num_gpus``, custom resources). A
  coroutine function runs on the worker process's one event loop
  (:func:`~closedloop.evals.harness.executor.worker_loop`), so what a worker builds once (domain
  data, model clients) serves every item it runs.

Fault tolerance is Ray's own, chosen so that nothing is lost or repeated:

* a worker process or node that dies mid-item: Ray runs the task again (``max_retries``, default 3)
  and the driver, which writes only what comes back, writes the item once;
* an exception raised by the work is a result (the benchmark's ``infra_error``), never retried by
  Ray (``retry_exceptions=False``): the benchmark decides what a failure means and resume re-runs it;
* a killed driver: Ray ends the driver's tasks with its job; the items it had not written have no
  row and run again on resume, exactly as locally;
* a cancelled item (Ctrl-C, an item timeout) is cancelled on the cluster too (``force=True``:
  the worker process exits, the work inside it cannot outlive the cancel).
"""

from __future__ import annotations

import asyncio
import inspect
import os
from typing import Any, Awaitable, Callable, TypeVar

import ray

from closedloop.evals.harness.executor import ExecutorConfig, ExecutorUnavailable, ItemWork, Resources, worker_loop

__all__ = ["RayExecutor", "connect"]

T = TypeVar("T")
R = TypeVar("R")


def connect(config: ExecutorConfig, *, local_resources: dict[str, float] | None = None, **init_options: Any) -> bool:
    """Join the cluster the config names, else ``$RAY_ADDRESS``, else start a Ray instance for this
    run (declaring ``local_resources``); returns whether this call connected (and so should
    disconnect). A driver already connected is left as it is.

    Why ``"local"`` and not Ray's default: ``ray.init()`` without an address joins whatever cluster
    ``ray start`` last started on this host, which on a shared machine may be someone else's."""
    if ray.is_initialized():
        return False
    address = config.address or os.environ.get("RAY_ADDRESS") or "local"
    options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True, **init_options}
    if address == "local" and local_resources:
        options["resources"] = dict(local_resources)
    if config.runtime_env:
        options["runtime_env"] = config.runtime_env
    ray.init(address=address, **options)
    return True


def _call(fn: Callable[[Any], Any], payload: Any) -> Any:
    """The body of every task: ``fn(payload)``, a coroutine function on the worker's loop."""
    if inspect.iscoroutinefunction(fn):
        return worker_loop().run(fn(payload))
    return fn(payload)


_remote_call = ray.remote(_call)


class RayExecutor:
    """Items as Ray tasks; see the module docstring for what runs where and what is retried."""

    name = "ray"
    in_process = False  # the cluster's scheduler places items by their resource requests

    def __init__(self, config: ExecutorConfig | None = None, *, local_resources: dict[str, float] | None = None,
                 **init_options: Any) -> None:
        self.config = config or ExecutorConfig(kind="ray")
        self._connected = connect(self.config, local_resources=local_resources, **init_options)

    def bind(self, work: ItemWork[T, R]) -> Callable[[T], Awaitable[R]]:
        if not work.can_leave_process:
            raise ExecutorUnavailable("this evaluation's items cannot run on Ray: its agent or model is an in-process "
                                      "object; give model specs (or run it with --executor local)")
        remote, payload, decode = work.remote, work.payload, work.decode
        assert remote is not None and payload is not None  # can_leave_process
        resources_of = work.resources or (lambda item: Resources())
        retries = self.config.max_retries

        async def run(item: T) -> R:
            task = _remote_call.options(max_retries=retries, retry_exceptions=False,
                                        **resources_of(item).ray_options())
            ref = task.remote(remote, payload(item))
            try:
                value = await ref
            except asyncio.CancelledError:
                ray.cancel(ref, force=True)
                raise
            return decode(item, value) if decode is not None else value

        return run

    @staticmethod
    def _per_node(asked: dict[str, float]) -> list[int]:
        """How many items asking ``asked`` (Ray's names) each alive node holds at once."""
        return [min(int(n.get("Resources", {}).get(k, 0.0) / v) for k, v in asked.items())
                for n in ray.nodes() if n.get("Alive")]

    def capacity(self, resources: Resources) -> int:
        """Items asking ``resources`` that the cluster's nodes hold at once now (at least 1), node
        by node: two one-GPU nodes hold no item asking two GPUs."""
        asked = resources.asked()
        if not asked:
            return max(1, int(ray.cluster_resources().get("CPU", 1)))
        return max(1, sum(self._per_node(asked)))

    def check(self, resources: Resources) -> None:
        """No alive node holds one item asking ``resources``: an error now, not tasks pending forever
        (an autoscaling cluster whose nodes with these resources are not up yet is refused too)."""
        asked = resources.asked()
        if asked and not any(self._per_node(asked)):
            have = sorted({k for n in ray.nodes() if n.get("Alive") for k in n.get("Resources", {})
                           if not k.startswith("node:") and "_group_" not in k})
            raise ExecutorUnavailable(
                f"no node of the Ray cluster has {resources.describe()} for one item (its nodes offer: "
                f"{', '.join(have) or 'nothing'}); start nodes with them (ray start --num-gpus N, or --resources "
                "'{\"NAME\": N}' for a custom one) or ask less (--ray-cpus, --ray-gpus)")

    def close(self) -> None:
        if self._connected and ray.is_initialized():
            ray.shutdown()
        self._connected = False
