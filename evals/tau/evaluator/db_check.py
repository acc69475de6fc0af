"""DB check: replay the episode's state-changing calls and the gold actions into two fresh
environments and compare their hashes (tau2 ``EnvironmentEvaluator``).

Only mutating tools are replayed for the prediction, in the order they ran; calls to tools that
do not exist are no-ops. In strict mode a replayed call whose output differs from the recorded
one is reported (the environment is not deterministic, or the record was edited). Every gold
action is replayed; a gold *write* that fails means the gold state is incomplete, so a match is
"not graded" rather than a pass.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from closedloop.evals.tau.data_model import Task
from closedloop.evals.tau.environment import Environment, EnvironmentFactory
from closedloop.evals.tau.simulation import DBCheck
from closedloop.messages import AssistantMessage, ToolMessage, _Message


@dataclass
class DBResult:
    check: DBCheck
    predicted: Environment
    gold_failures: list[dict[str, Any]] = field(default_factory=list)
    replay_mismatches: list[dict[str, Any]] = field(default_factory=list)


def replay_trajectory(env: Environment, messages: list[_Message], *, strict: bool = True) -> list[dict[str, Any]]:
    """Re-run the mutating tool calls of ``messages`` into ``env``; returns output mismatches."""
    recorded = {m.tool_call_id: m for m in messages if isinstance(m, ToolMessage)}
    mismatches: list[dict[str, Any]] = []
    for msg in messages:
        if not isinstance(msg, AssistantMessage) or not msg.tool_calls:
            continue
        for call in msg.tool_calls:
            if not env.is_mutating_tool(call.name):
                continue
            result = env.run_tool_call(call)
            before = recorded.get(call.id)
            if strict and before is not None and before.text != result.text:
                mismatches.append({"tool_call_id": call.id, "name": call.name,
                                   "recorded": before.text[:500], "replayed": result.text[:500]})
    return mismatches


def replay_gold(env: Environment, task: Task) -> list[dict[str, Any]]:
    """Run every gold action; returns the gold *writes* that failed (reads may fail harmlessly)."""
    failures: list[dict[str, Any]] = []
    actions = task.evaluation_criteria.actions if task.evaluation_criteria else None
    for action in actions or []:
        try:
            env.make_tool_call(action.name, action.requestor, **action.arguments)
        except Exception as e:
            if env.is_mutating_tool(action.name, action.requestor):
                failures.append({"action_id": action.action_id, "tool_name": action.name,
                                 "error_type": type(e).__name__, "error": str(e)})
    return failures


# Gold states depend only on the data and the task, so k trials of a task replay the gold
# actions once. Only factories that name their data (a ``cache_key``) are cached.
_GOLD_CACHE: "OrderedDict[tuple, tuple[str, str | None, list[dict[str, Any]]]]" = OrderedDict()
_GOLD_CACHE_SIZE = 4096


def _factory_key(factory: EnvironmentFactory) -> Any:
    key = getattr(factory, "cache_key", None)
    if key is None:
        key = getattr(getattr(factory, "__self__", None), "cache_key", None)
    return key


def _gold_state(task: Task, environment_factory: EnvironmentFactory) -> tuple[str, str | None, list[dict[str, Any]]]:
    data_key = _factory_key(environment_factory)
    key = None
    if data_key is not None:
        criteria = task.evaluation_criteria.model_dump_json() if task.evaluation_criteria else ""
        initial = task.initial_state.model_dump_json() if task.initial_state else ""
        key = (data_key, task.id, criteria, initial)
        if key in _GOLD_CACHE:
            _GOLD_CACHE.move_to_end(key)
            gold_hash, user_hash, failures = _GOLD_CACHE[key]
            return gold_hash, user_hash, json.loads(json.dumps(failures))
    gold = environment_factory()
    gold.apply_initial_state(task.initial_state)
    failures = replay_gold(gold, task)
    result = (gold.get_db_hash(), gold.get_user_db_hash(), failures)
    if key is not None:
        _GOLD_CACHE[key] = result
        if len(_GOLD_CACHE) > _GOLD_CACHE_SIZE:
            _GOLD_CACHE.popitem(last=False)
    return result


def check_db(messages: list[_Message], task: Task, environment_factory: EnvironmentFactory,
             *, strict: bool = True) -> DBResult:
    predicted = environment_factory()
    predicted.apply_initial_state(task.initial_state)
    mismatches = replay_trajectory(predicted, messages, strict=strict)
    gold_hash, gold_user_hash, failures = _gold_state(task, environment_factory)
    pred_hash = predicted.get_db_hash()
    user_match = gold_user_hash == predicted.get_user_db_hash()
    match = gold_hash == pred_hash and user_match
    check = DBCheck(db_match=match, db_reward=1.0 if match else 0.0, gold_hash=gold_hash, predicted_hash=pred_hash,
                    user_db_match=user_match if gold_user_hash is not None else None)
    return DBResult(check, predicted, failures, mismatches)
