"""Training rows from stored trajectories: SFT conversations, preference pairs, GRPO groups.

The rows follow TRL's dataset formats, so ``datasets.load_dataset("json", data_files=...)`` feeds
them to TRL (or to closedloop's trainers) unchanged:

- SFT (:func:`sft_rows`): conversational language modelling, ``{"messages": [...]}`` with OpenAI
  message dicts, plus ``tools`` (OpenAI function schemas) when the run recorded them under
  ``metadata["tools"]``, the summed ``reward`` and the ``run_id``.
- preference pairs (:func:`preference_pairs`): TRL's conversational preference format,
  ``{"prompt": [...], "chosen": [...], "rejected": [...]}``: the prompt is every message before
  the first assistant message, chosen/rejected the rest of the higher/lower-reward episode.
- GRPO groups (:func:`grpo_groups`): the episodes of one task, ``{"task_id", "trajectories",
  "rewards"}``, for group-normalised advantages.

Which episodes share a task (:func:`task_key`): ``metadata["task_id"]`` as the store fills it
(recorded metadata, else the run config's ``task_id``, else the outcome's, else a ``task:<id>``
tag; see :func:`closedloop.store.records.trajectory_metadata`); an episode with none falls back
to its prompt, so episodes that started from identical messages form one task.

The reward of an episode is the sum of its named rewards (``Trajectory.rewards``); episodes
without any reward are left out of pairs and groups (they say nothing about preference).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

from closedloop.messages import AssistantMessage, Trajectory, _Message

__all__ = ["ExportFormat", "task_key", "total_reward", "prompt_and_completion", "sft_rows", "preference_pairs",
           "grpo_groups", "rows_for", "write_jsonl"]

ExportFormat = Literal["sft", "pairs", "groups"]


def total_reward(trajectory: Trajectory) -> float | None:
    """The sum of the named rewards, or None when the episode has none."""
    return float(sum(trajectory.rewards.values())) if trajectory.rewards else None


def prompt_and_completion(trajectory: Trajectory) -> tuple[list[_Message], list[_Message]]:
    """(messages before the first assistant message, that message and everything after it)."""
    for i, m in enumerate(trajectory.messages):
        if isinstance(m, AssistantMessage):
            return list(trajectory.messages[:i]), list(trajectory.messages[i:])
    return list(trajectory.messages), []


def _openai(messages: Iterable[_Message]) -> list[dict[str, Any]]:
    return [m.to_openai() for m in messages]


def task_key(trajectory: Trajectory) -> str:
    """The task an episode belongs to (see the module docstring); always a string."""
    task = trajectory.metadata.get("task_id")
    if task is not None:
        return str(task)
    prompt, _ = prompt_and_completion(trajectory)
    digest = hashlib.sha256(json.dumps(_openai(prompt), sort_keys=True).encode()).hexdigest()[:16]
    return f"prompt:{digest}"


def _tools(trajectory: Trajectory) -> list[dict[str, Any]] | None:
    tools = trajectory.metadata.get("tools")
    if isinstance(tools, list) and all(isinstance(t, dict) for t in tools):
        return tools
    return None


def sft_rows(trajectories: Iterable[Trajectory]) -> Iterator[dict[str, Any]]:
    """One row per episode with at least one assistant message."""
    for traj in trajectories:
        if not any(isinstance(m, AssistantMessage) for m in traj.messages):
            continue
        row: dict[str, Any] = {"messages": _openai(traj.messages)}
        tools = _tools(traj)
        if tools is not None:
            row["tools"] = tools
        row["reward"] = total_reward(traj)
        row["run_id"] = traj.metadata.get("run_id", traj.id)
        yield row


def _by_task(trajectories: Iterable[Trajectory]) -> dict[str, list[tuple[Trajectory, float]]]:
    groups: dict[str, list[tuple[Trajectory, float]]] = defaultdict(list)
    for traj in trajectories:
        reward = total_reward(traj)
        if reward is not None:
            groups[task_key(traj)].append((traj, reward))
    return groups


def preference_pairs(trajectories: Iterable[Trajectory], *, strategy: Literal["all", "best_worst"] = "all",
                     min_margin: float = 0.0, require_same_prompt: bool = True) -> Iterator[dict[str, Any]]:
    """Pairs of episodes of the same task whose rewards differ (by more than ``min_margin``).

    ``strategy="all"``: every such pair (n episodes give up to n(n-1)/2); ``"best_worst"``: one
    pair per task, its highest against its lowest reward (first recorded wins a tie). With
    ``require_same_prompt`` (default) two episodes pair only if their prompts are identical, since
    TRL trains chosen and rejected as continuations of one shared prompt; turn it off for tasks
    whose opening message is sampled (a simulated user), and the chosen episode's prompt is used.
    """
    if strategy not in ("all", "best_worst"):
        raise ValueError(f"strategy must be 'all' or 'best_worst', got {strategy!r}")
    if min_margin < 0:
        raise ValueError("min_margin must be >= 0")
    for task, episodes in _by_task(trajectories).items():
        split = [(t, r, *prompt_and_completion(t)) for t, r in episodes]
        split = [s for s in split if s[3]]  # an episode without an assistant message has no completion
        if strategy == "best_worst":
            if len(split) < 2:
                continue
            best = max(split, key=lambda s: s[1])
            worst = min(split, key=lambda s: s[1])
            candidates = [(best, worst)]
        else:
            candidates = [(a, b) if a[1] >= b[1] else (b, a)
                          for i, a in enumerate(split) for b in split[i + 1:]]
        for (ct, cr, cp, cc), (rt, rr, rp, rc) in candidates:
            if cr - rr <= min_margin:
                continue
            prompt = _openai(cp)
            if require_same_prompt and prompt != _openai(rp):
                continue
            yield {"prompt": prompt, "chosen": _openai(cc), "rejected": _openai(rc), "chosen_reward": cr,
                   "rejected_reward": rr, "task_id": task, "chosen_id": ct.metadata.get("run_id", ct.id),
                   "rejected_id": rt.metadata.get("run_id", rt.id)}


def grpo_groups(trajectories: Iterable[Trajectory], *, min_size: int = 1) -> Iterator[dict[str, Any]]:
    """One group per task (in order of first appearance) with at least ``min_size`` rewarded episodes."""
    if min_size < 1:
        raise ValueError("min_size must be >= 1")
    for task, episodes in _by_task(trajectories).items():
        if len(episodes) >= min_size:
            yield {"task_id": task, "trajectories": [t.metadata.get("run_id", t.id) for t, _ in episodes],
                   "rewards": [r for _, r in episodes]}


def rows_for(fmt: ExportFormat, trajectories: Iterable[Trajectory], **options: Any) -> Iterator[dict[str, Any]]:
    """The rows of one export format; ``options`` go to its builder."""
    builders = {"sft": sft_rows, "pairs": preference_pairs, "groups": grpo_groups}
    if fmt not in builders:
        raise ValueError(f"format must be one of {sorted(builders)}, got {fmt!r}")
    return builders[fmt](trajectories, **options)


def write_jsonl(rows: Iterable[dict[str, Any]], path: str | os.PathLike[str]) -> int:
    """Write rows as JSON lines (atomically: a temporary file renamed into place); returns the count."""
    out = Path(path).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    n = 0
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    os.replace(tmp, out)
    return n
