"""Where an evaluation item's work runs: in this process (``local``, the default) or on a Ray cluster.

Why an executor and not a second runner: everything that makes a batch safe stays in one place,
:class:`~closedloop.evals.harness.runner.BatchRunner`, in the driver: the plan order, at most
``concurrency`` items in flight, timeouts and harness failures turned into results, and the
serialised, transactional writes to the one run store (so resume works exactly as it does
locally). The executor decides only where one item's work happens:

* ``local`` awaits the item's coroutine on this event loop (today's behaviour; needs no Ray);
* ``ray`` (:mod:`closedloop.evals.harness.ray_executor`, extra ``closedloop[ray]``) sends the item
  to a Ray task with the item's resource request (``num_gpus=1`` for a timed kernel, CPU slots
  for τ grading) and awaits its result, which comes back to the driver to be written.

A benchmark describes an item's work once as :class:`ItemWork`: the coroutine that runs it here,
and for remote executors an importable function of a picklable payload, the item's
:class:`Resources`, and how the returned value becomes the result the driver writes. A benchmark
whose items cannot leave the process (an in-process callable as agent) simply gives no remote
function; asking for ``ray`` then fails before anything runs.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Coroutine, Generic, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from closedloop.evals.harness.flags import EXECUTORS

__all__ = ["EXECUTORS", "Executor", "ExecutorConfig", "ExecutorUnavailable", "ItemWork", "LocalExecutor",
           "Resources", "worker_loop"]

T = TypeVar("T")
R = TypeVar("R")


class ExecutorUnavailable(RuntimeError):
    """The executor asked for cannot run here (Ray not installed, or the work cannot leave the process)."""


class Resources(BaseModel):
    """What one item (or one rollout actor) asks the cluster for; Ray's own resource names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_cpus: float = Field(1.0, ge=0, description="CPU slots (fractions allowed: 0.25 packs four model-bound "
                                                   "episodes on one core).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs (1 for a timed kernel: one sample per device).")
    memory_mb: int | None = Field(None, ge=1, description="Memory reserved for the item (Ray's `memory`), if any.")
    custom: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources, e.g. {'cpu_timing': 1} "
                                                                       "declared once per node.")

    def over(self, default: "Resources") -> "Resources":
        """``default`` with the fields given here replacing its own: ``--ray-cpus 2`` on a benchmark
        whose items ask a GPU keeps the GPU."""
        return default.model_copy(update={k: getattr(self, k) for k in self.model_fields_set})

    def asked(self) -> dict[str, float]:
        """The non-zero requests in Ray's resource names (``CPU``, ``GPU``, ``memory`` in bytes, custom)."""
        asked = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.custom}
        if self.memory_mb is not None:
            asked["memory"] = self.memory_mb * 1024 * 1024
        return {k: v for k, v in asked.items() if v > 0}

    def describe(self) -> str:
        """The request for a message, e.g. ``CPU 1, GPU 1, cpu_timing 1``."""
        return ", ".join(f"{k} {v:g}" for k, v in self.asked().items()) or "nothing"

    def ray_options(self) -> dict[str, Any]:
        """Keyword options of ``ray.remote(...).options``."""
        out: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory_mb is not None:
            out["memory"] = self.memory_mb * 1024 * 1024
        if self.custom:
            out["resources"] = dict(self.custom)
        return out


class ExecutorConfig(BaseModel):
    """The executor of an evaluation (``--executor``) or of a trainer's rollouts (config key ``executor``).

    A plain string (``executor: ray``) is read as ``{kind: ray}``.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["local", "ray"] = Field("local", description="local: this process (the default, needs no Ray); "
                                                               "ray: a Ray cluster (pip install 'closedloop[ray]').")
    address: str | None = Field(None, description="ray: the cluster to join ('auto', 'HOST:6379', 'ray://HOST:10001'); "
                                                  "unset: the RAY_ADDRESS environment variable, else a local Ray "
                                                  "instance started for this run.")
    workers: int = Field(2, ge=1, description="ray, trainers: rollout actors, each holding a copy of the policy.")
    resources: Resources | None = Field(None, description="ray: per item (evaluations) or per rollout actor "
                                                          "(trainers); unset: the benchmark's or trainer's default.")
    runtime_env: dict[str, Any] | None = Field(None, description="ray: Ray's runtime_env for the job (e.g. "
                                                                 "{'env_vars': {...}}); closedloop must be installed "
                                                                 "on every node.")
    max_retries: int = Field(3, ge=0, description="ray: times a task is re-run after its worker process or node died "
                                                  "(Ray's max_retries; an exception raised by the work is a result, "
                                                  "never retried).")

    def item_resources(self, default: Resources) -> Resources:
        """What one item asks for: the benchmark's ``default`` with the fields the user set."""
        return self.resources.over(default) if self.resources is not None else default

    @model_validator(mode="before")
    @classmethod
    def _plain_kind(cls, value: Any) -> Any:
        return {"kind": value} if isinstance(value, str) else value


@dataclass(frozen=True)
class ItemWork(Generic[T, R]):
    """One item's work, described for every executor.

    ``local(item)``: the coroutine that runs it in this process. For remote executors: ``remote``, a
    module-level function (sync or ``async``; it is sent by reference, so it must be importable
    where it runs) of ``payload(item)``, whose return value ``decode(item, value)`` turns into the
    result the driver writes; ``resources(item)`` is what the item asks the cluster for.
    """

    local: Callable[[T], Awaitable[R]]
    remote: Callable[[Any], Any] | None = None
    payload: Callable[[T], Any] | None = None
    decode: Callable[[T, Any], R] | None = None
    resources: Callable[[T], Resources] | None = None

    @property
    def can_leave_process(self) -> bool:
        return self.remote is not None and self.payload is not None


class Executor(Protocol):
    """Runs an item's work somewhere; the batch runner owns everything else."""

    name: str
    config: ExecutorConfig
    #: whether items run in this process: in-process resource slots and pools apply (a remote
    #: scheduler places items by their resource requests instead)
    in_process: bool

    def bind(self, work: ItemWork[T, R]) -> Callable[[T], Awaitable[R]]:
        """The coroutine function that runs one item where this executor runs it."""
        ...

    def capacity(self, resources: Resources) -> int:
        """How many items asking ``resources`` can run at once (the default concurrency; at least 1)."""
        ...

    def check(self, resources: Resources) -> None:
        """Raise :class:`ExecutorUnavailable` when no item asking ``resources`` could ever start
        (on Ray: no node has them all), rather than letting the items wait forever."""
        ...

    def close(self) -> None:
        """Release what the executor started (a Ray instance it started stops)."""
        ...


class LocalExecutor:
    """Today's behaviour: the item's coroutine on this event loop."""

    name = "local"
    in_process = True

    def __init__(self, config: ExecutorConfig | None = None) -> None:
        self.config = config or ExecutorConfig()

    def bind(self, work: ItemWork[T, R]) -> Callable[[T], Awaitable[R]]:
        return work.local

    def capacity(self, resources: Resources) -> int:
        return 4  # the historical default of `closedloop eval --concurrency`

    def check(self, resources: Resources) -> None:
        return None  # in-process slots, not resource requests, bound local items

    def close(self) -> None:
        return None


class _WorkerLoop:
    """One event loop per worker process, on its own thread, for remote work that is a coroutine.

    Why one loop for the process: clients a worker builds once and reuses across items (an
    ``openai:`` connection pool, an ``hf:`` engine's decode loop) are bound to the loop they were
    first used on; a fresh ``asyncio.run`` per item would strand them."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="closedloop-worker-loop", daemon=True).start()

    def run(self, coro: Coroutine[Any, Any, R]) -> R:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


_LOOP: _WorkerLoop | None = None
_LOOP_LOCK = threading.Lock()


def worker_loop() -> _WorkerLoop:
    """This process's worker loop (started on first use)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = _WorkerLoop()
        return _LOOP
