"""Export in the shape of tau2's ``results.json``: ``{timestamp, info, tasks, simulations}``.

Messages are written in tau2's message format (``role``, ``content``, ``tool_calls`` with parsed
``arguments`` and ``requestor``, tool messages with ``id``, ``requestor`` and a boolean
``error``), so tau2 tooling (``tau2 view``, ``tau2 evaluate-trajs``) can read the file for
cross-grading. Our own fields (``task_file_sha256``, ``not_graded``, usage) ride along; tau2's
models ignore what they do not know.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from closedloop.evals.tau.data_model import Task
from closedloop.evals.tau.simulation import SimulationRun
from closedloop.messages import AssistantMessage, SystemMessage, ToolMessage, UserMessage, _Message

__all__ = ["RunInfo", "tau2_message", "results_dict", "write_results"]


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


def _arguments(raw: str) -> Any:
    try:
        return json.loads(raw or "{}")
    except json.JSONDecodeError:
        return raw  # malformed arguments stay as the model sent them


def tau2_message(message: _Message, turn_idx: int, requestors: dict[str, str]) -> dict[str, Any]:
    base: dict[str, Any] = {"role": message.role, "turn_idx": turn_idx}
    if isinstance(message, ToolMessage):
        base.update(id=message.tool_call_id, content=message.text,
                    requestor=requestors.get(message.tool_call_id, "assistant"), error=message.error is not None)
        return base
    if isinstance(message, (AssistantMessage, UserMessage, SystemMessage)):
        content = getattr(message, "content", None)
        base["content"] = message.text if content is not None else None
    if isinstance(message, AssistantMessage) and message.tool_calls:
        base["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": _arguments(c.function.arguments),
                               "requestor": "assistant"} for c in message.tool_calls]
    return base


def _simulation_dict(sim: SimulationRun) -> dict[str, Any]:
    requestors = {c.id: "assistant" for m in sim.messages if isinstance(m, AssistantMessage) and m.tool_calls
                  for c in m.tool_calls}
    data = sim.model_dump(mode="json", exclude={"messages", "agent_turns"})
    data["messages"] = [tau2_message(m, i, requestors) for i, m in enumerate(sim.messages)]
    return data


def results_dict(simulations: list[SimulationRun], tasks: list[Task], info: RunInfo) -> dict[str, Any]:
    from closedloop.store.redact import redact

    # Model specs in ``info`` (``openai:m@http://user:key@host``) and keys echoed in messages or
    # errors never reach the exported file; simulations get the content rules (field names kept).
    return {"timestamp": datetime.now(timezone.utc).isoformat(), "info": redact(info.model_dump(mode="json")),
            "tasks": [t.model_dump(mode="json") for t in tasks],
            "simulations": redact([_simulation_dict(s) for s in simulations], keys=False, key_values=False,
                                  hex_keys=False)}


def write_results(path: str | Path, simulations: list[SimulationRun], tasks: list[Task], info: RunInfo) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results_dict(simulations, tasks, info), indent=2))
    return path
