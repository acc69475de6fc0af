"""Export in the shape of tau2's ``results.json``: ``{timestamp, info, tasks, simulations}``.

Messages are written in tau2's message format (``role``, ``content``, ``tool_calls`` with parsed
``arguments`` and ``requestor``, tool messages with ``id``, ``requestor`` and a boolean
``error``), so tau2 tooling (``tau2 view``, ``tau2 evaluate-trajs``) can read the file for
cross-grading, and tau2's ``Results.load`` accepts the file (``info.environment_info.policy``
is written; ``reward_info`` is tau2's record, or ``null`` for an ungraded episode, never
``reward: null``). Our own fields ride along under names tau2 does not use
(``closedloop_reward_info``, ``closedloop_agent_usage``, ...); tau2's models ignore them.
:func:`load_tau2_results` reads such a file, or one tau2 wrote, back for pass^k and analysis.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from closedloop.evals.tau.conventions import Conventions
from closedloop.evals.tau.data_model import Task
from closedloop.evals.tau.simulation import SimulationRun
from closedloop.messages import AssistantMessage, SystemMessage, ToolCall, ToolMessage, UserMessage, _Message

__all__ = ["RunInfo", "tau2_message", "from_tau2_message", "results_dict", "write_results", "load_tau2_results"]


class RunInfo(BaseModel):
    git_commit: str = ""
    num_trials: int = 1
    max_steps: int = 200
    max_errors: int = 10
    seed: int | None = None
    user_info: dict[str, Any] = Field(default_factory=lambda: {"implementation": "user_simulator"})
    agent_info: dict[str, Any] = Field(default_factory=lambda: {"implementation": "closedloop"})
    environment_info: dict[str, Any] = Field(default_factory=dict)
    task_file_sha256: str | None = None
    data_dir: str | None = None
    task_split: str | None = None
    conventions: Conventions = Field(default_factory=Conventions)  # how rewards and metrics were computed


def _tool_arguments(raw: str) -> dict[str, Any]:
    """tau2 requires a JSON object; malformed arguments are kept under a key of their own."""
    try:
        value = json.loads(raw or "{}")
    except json.JSONDecodeError:
        return {"__malformed_arguments__": raw}
    return value if isinstance(value, dict) else {"__malformed_arguments__": raw}


def tau2_message(message: _Message, turn_idx: int, requestors: dict[str, str]) -> dict[str, Any]:
    base: dict[str, Any] = {"role": message.role, "turn_idx": turn_idx}
    if isinstance(message, ToolMessage):
        base.update(id=message.tool_call_id, content=message.text,
                    requestor=requestors.get(message.tool_call_id, "assistant"), error=message.error is not None)
        return base
    if isinstance(message, (AssistantMessage, UserMessage, SystemMessage)):
        content = getattr(message, "content", None)
        base["content"] = message.text if content is not None else None
    calls = getattr(message, "tool_calls", None)
    if isinstance(message, (AssistantMessage, UserMessage)) and calls:
        who = "assistant" if isinstance(message, AssistantMessage) else "user"
        base["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": _tool_arguments(c.function.arguments),
                               "requestor": who} for c in calls]
    return base


def from_tau2_message(raw: dict[str, Any]) -> _Message:
    """One message of a tau2 results file (or trajectory) as ours."""
    role = raw.get("role")
    content = raw.get("content")
    if role == "tool":
        error = bool(raw.get("error"))
        return ToolMessage(tool_call_id=raw["id"], content=content if content is not None else "",
                           error=(content or "error") if error else None)
    if role == "assistant":
        calls = [ToolCall.make(c["name"], c.get("arguments") or {}, id=c["id"]) for c in raw.get("tool_calls") or []]
        return AssistantMessage(content=content, tool_calls=calls or None)
    if role == "user":
        if raw.get("tool_calls"):
            from closedloop.evals.tau.user_messages import TauUserMessage

            calls = [ToolCall.make(c["name"], c.get("arguments") or {}, id=c["id"]) for c in raw["tool_calls"]]
            return TauUserMessage(content=content, tool_calls=calls)
        return UserMessage(content=content if content is not None else "")
    if role == "system":
        return SystemMessage(content=content or "")
    raise ValueError(f"unknown tau2 message role {role!r}")


# Our SimulationRun fields whose type differs from tau2's field of the same name: renamed on export.
_RENAMED = {"agent_usage": "closedloop_agent_usage", "user_usage": "closedloop_user_usage"}


def _simulation_dict(sim: SimulationRun) -> dict[str, Any]:
    requestors = {c.id: "assistant" for m in sim.messages if isinstance(m, AssistantMessage) and m.tool_calls
                  for c in m.tool_calls}
    from closedloop.evals.tau.user_messages import requestors as _requestors

    requestors.update(_requestors(sim.messages))
    data = sim.model_dump(mode="json", exclude={"messages", "agent_turns", "reward_info"})
    for ours, theirs in _RENAMED.items():
        data[theirs] = data.pop(ours)
    # tau2 has no ungraded reward: an ungraded episode carries reward_info null (and counts as a
    # failure in tau2's pass^k); our full record, with why it was not graded, rides along.
    data["reward_info"] = sim.reward_info.to_tau2() if sim.reward_info is not None else None
    if sim.reward_info is not None:
        data["closedloop_reward_info"] = sim.reward_info.model_dump(mode="json")
    data["messages"] = [tau2_message(m, i, requestors) for i, m in enumerate(sim.messages)]
    return data


def _policy(info: RunInfo) -> str:
    """tau2's loader requires ``info.environment_info.policy``: the domain's policy text."""
    env = info.environment_info
    if isinstance(env.get("policy"), str):
        return env["policy"]
    try:
        from closedloop.evals.tau.data import load_domain

        return load_domain(env.get("domain_name", ""), info.data_dir).policy
    except Exception:
        return ""


def results_dict(simulations: list[SimulationRun], tasks: list[Task], info: RunInfo) -> dict[str, Any]:
    info_dict = info.model_dump(mode="json")
    info_dict["environment_info"] = {"domain_name": info.environment_info.get("domain_name", ""),
                                     "policy": _policy(info), "tool_defs": None,
                                     **{k: v for k, v in info.environment_info.items()
                                        if k not in ("domain_name", "policy", "tool_defs")}}
    from closedloop.redact import redact

    # Model specs in ``info`` (``openai:m@http://user:key@host``) and keys echoed in messages or
    # errors never reach the exported file; simulations get the content rules (field names kept).
    # The domain policy is tau2's text, kept byte for byte; everything else in ``info`` is redacted.
    info_dict = {k: ({ek: (ev if ek == "policy" else redact({ek: ev})[ek]) for ek, ev in v.items()}
                     if k == "environment_info" else redact({k: v})[k]) for k, v in info_dict.items()}
    return {"timestamp": datetime.now(timezone.utc).isoformat(), "info": info_dict,
            "tasks": [t.model_dump(mode="json") for t in tasks],
            "simulations": redact([_simulation_dict(s) for s in simulations], keys=False, key_values=False,
                                  hex_keys=False)}


def write_results(path: str | Path, simulations: list[SimulationRun], tasks: list[Task], info: RunInfo) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results_dict(simulations, tasks, info), indent=2))
    return path


def load_tau2_results(path: str | Path) -> tuple[list[SimulationRun], list[Task], dict[str, Any]]:
    """Read a tau2 ``results.json`` (written by tau2 or by us): simulations, tasks and ``info``.

    Each simulation keeps tau2's ``reward_info`` (``null`` stays None: ungraded), so
    :func:`~closedloop.evals.tau.metrics.compute_metrics` gives pass^k over tau2's own runs."""
    from closedloop.evals.tau.simulation import RewardInfo

    path = Path(path)
    if path.is_dir() or (path.parent / "simulations").is_dir():
        raise ValueError(f"{path}: tau2's directory format is not supported; pass a single-file results.json")
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict) or "info" not in raw or "tasks" not in raw:
        raise ValueError(f"{path} is not a tau2 results file (needs 'info' and 'tasks')")
    tasks = [Task.model_validate(t) for t in raw["tasks"]]
    sims: list[SimulationRun] = []
    domain = (raw["info"].get("environment_info") or {}).get("domain_name", "")
    for s in raw.get("simulations") or []:
        ours = s.get("closedloop_reward_info")
        ri = s.get("reward_info")
        reward_info = (RewardInfo.model_validate(ours) if ours is not None else
                       RewardInfo.model_validate(ri) if ri is not None else None)
        sims.append(SimulationRun(
            id=s["id"], task_id=str(s["task_id"]), domain=domain, trial=s.get("trial"), seed=s.get("seed"),
            start_time=s.get("start_time") or "", end_time=s.get("end_time") or "",
            duration=float(s.get("duration") or 0.0), termination_reason=s["termination_reason"],
            agent_cost=s.get("agent_cost"), user_cost=s.get("user_cost"), reward_info=reward_info,
            messages=[from_tau2_message(m) for m in s.get("messages") or []]))
    return sims, tasks, raw["info"]
