"""Choosing the executor: from a config (:func:`make_executor`) or from the command-line flags of
:mod:`~closedloop.evals.harness.flags` (:func:`executor_config_from_args`).

Apart from :mod:`~closedloop.evals.harness.executor` because the Ray executor builds on that
module's types: the choice imports both, neither imports the choice.
"""

from __future__ import annotations

import argparse

from closedloop.evals.harness.executor import Executor, ExecutorConfig, ExecutorUnavailable, LocalExecutor, Resources

__all__ = ["executor_config_from_args", "make_executor"]


def make_executor(config: ExecutorConfig | str | None = None, *,
                  local_resources: dict[str, float] | None = None) -> Executor:
    """The executor a config names; ``ray`` without Ray installed is a clear error.

    ``local_resources``: custom resources a Ray instance started for this run declares (a
    benchmark's per-node slots, e.g. KernelBench's ``cpu_timing``); a cluster that is joined
    declares its own (``ray start --resources``)."""
    cfg = ExecutorConfig.model_validate(config or "local")
    if cfg.kind == "local":
        return LocalExecutor(cfg)
    try:
        from closedloop.evals.harness.ray_executor import RayExecutor
    except ModuleNotFoundError as e:
        if e.name != "ray" and not (e.name or "").startswith("ray."):
            raise
        raise ExecutorUnavailable("--executor ray needs Ray: pip install 'closedloop[ray]'") from None
    return RayExecutor(cfg, local_resources=local_resources)


def executor_config_from_args(args: argparse.Namespace) -> ExecutorConfig:
    """The :class:`~closedloop.evals.harness.executor.ExecutorConfig` the flags name; its
    ``resources`` hold only the fields given (the benchmark's request fills the rest). A Ray flag
    without ``--executor ray`` is refused rather than silently ignored."""
    given = {k: v for k, v in (("num_cpus", args.ray_cpus), ("num_gpus", args.ray_gpus)) if v is not None}
    if args.executor != "ray":
        named = [flag for flag, v in (("--ray-address", args.ray_address), ("--ray-cpus", args.ray_cpus),
                                      ("--ray-gpus", args.ray_gpus)) if v is not None]
        if named:
            raise ValueError(f"{', '.join(named)} needs --executor ray")
    return ExecutorConfig(kind=args.executor, address=args.ray_address, resources=Resources(**given) if given else None)
