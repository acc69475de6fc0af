"""Where we let a run differ from tau2, by name; tau2's behaviour is every default.

A run records its conventions (the eval's settings, and ``info.conventions`` of the results.json
it exports), so a file says how its rewards and metrics were computed:

- ``gold_sync``: tau2's evaluator replays the gold actions with ``make_tool_call``, which does not
  call ``sync_tools``, while the trajectory's calls were synced; on telecom the gold user DB then
  keeps stale surroundings and ``db_match`` is false for trajectories that reached the gold
  actions' live state. ``True`` syncs the gold replay as live calls are (ours; never changes a
  telecom reward, whose basis has no DB).
- ``ungraded``: ``"fail"`` (tau2) counts an episode without a reward (no judge) as a failure in
  pass^k; ``"exclude"`` leaves it out (ours: it says nothing about the agent).
- ``pass_k``: ``"capped"`` (tau2) computes pass^k only up to the smallest trial count of any task;
  ``"per-task"`` computes each k over the tasks that have k trials (ours).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

__all__ = ["Conventions", "UngradedRule", "PassKRule"]

UngradedRule = Literal["fail", "exclude"]
PassKRule = Literal["capped", "per-task"]


class Conventions(BaseModel):
    gold_sync: bool = False
    ungraded: UngradedRule = "fail"
    pass_k: PassKRule = "capped"

    def not_tau2(self) -> dict[str, Any]:
        """The conventions that differ from tau2's (empty: tau2's figures)."""
        default = Conventions()
        return {k: v for k, v in self.model_dump().items() if getattr(default, k) != v}
