"""DB check: replay the episode's state-changing calls and the gold actions into two fresh
environments and compare their hashes (tau2 ``EnvironmentEvaluator``).

Only mutating tools are replayed for the prediction, in the order they ran, as live calls
(each successful one reconciles a dual-control domain's two DBs, ``sync_tools``); calls to tools
that do not exist are no-ops. In strict mode a replayed call whose output differs from the
recorded one is reported (the environment is not deterministic, or the record was edited).

Every gold action is replayed as tau2's evaluator replays it, with ``make_tool_call``, which does
not sync: on telecom the gold user DB keeps the surroundings (roaming, data-usage flags, payment
request) of before the gold calls, so a trajectory that reached the gold state live can still
have ``db_match: false``, as in tau2 (the reward never changes: no telecom task has DB in its
basis). ``gold_sync=True`` syncs after each successful gold call instead, as live calls do, so
``db_match`` says whether the trajectory reached the gold actions' live state. A gold action that
fails is recorded and the replay carries on (tau2 logs it).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

from closedloop.evals.tau.data_model import Task
from closedloop.evals.tau.environment import Environment, EnvironmentFactory
from closedloop.evals.tau.simulation import DBCheck
from closedloop.evals.tau.user_messages import tool_calls_of
from closedloop.messages import ToolMessage, _Message


@dataclass
class DBResult:
    check: DBCheck
    predicted: Environment | None  # None when the state came from the cache
    gold_failures: list[dict[str, Any]] = field(default_factory=list)
    replay_mismatches: list[dict[str, Any]] = field(default_factory=list)


def replay_trajectory(env: Environment, messages: Sequence[_Message], *, strict: bool = True) -> list[dict[str, Any]]:
    """Re-run the mutating tool calls of ``messages`` (the agent's and the user's) into ``env``;
    returns output mismatches. Calls to tools that do not exist are no-ops, as in tau2."""
    recorded = {m.tool_call_id: m for m in messages if isinstance(m, ToolMessage)}
    mismatches: list[dict[str, Any]] = []
    for call, requestor in tool_calls_of(messages):
        if not env.is_mutating_tool(call.name, requestor):
            continue
        result = env.run_tool_call(call, requestor)
        before = recorded.get(call.id)
        if strict and before is not None and _content(before.text) != _content(result.text):
            mismatches.append({"tool_call_id": call.id, "name": call.name,
                               "recorded": before.text[:500], "replayed": result.text[:500]})
    env.sync_tools()  # tau2's set_state ends with one
    return mismatches


def _content(text: str) -> Any:
    """tau2 compares replayed outputs as parsed JSON when they parse."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return text


def replay_gold(env: Environment, task: Task, *, sync: bool = False) -> list[dict[str, Any]]:
    """Run every gold action as tau2's evaluator does (``make_tool_call``, no ``sync_tools``;
    ``sync``: after each successful one); returns those that raised (tau2 logs them and carries on)."""
    failures: list[dict[str, Any]] = []
    actions = task.evaluation_criteria.actions if task.evaluation_criteria else None
    for action in actions or []:
        try:
            env.make_tool_call(action.name, action.requestor, **action.arguments)
            if sync:
                env.sync_tools()
        except Exception as e:
            failures.append({"action_id": action.action_id, "tool_name": action.name,
                             "mutating": env.is_mutating_tool(action.name, action.requestor),
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


def gold_cache_key(task: Task, data_key: Any, *, gold_sync: bool = False) -> tuple | None:
    """The key of a task's gold state for data named ``data_key`` (a ``cache_key``); equal in
    every process that loads the same data, so a runner and its grading workers share states."""
    if data_key is None:
        return None
    actions = task.evaluation_criteria.actions if task.evaluation_criteria else None
    criteria = json.dumps([a.model_dump(mode="json") for a in actions or []])  # the basis does not matter
    initial = task.initial_state.model_dump_json() if task.initial_state else ""
    return (data_key, task.id, criteria, initial) + (("gold_sync",) if gold_sync else ())


GoldState = tuple  # (db hash, user db hash or None, gold failures)


def cached_gold(key: tuple | None) -> GoldState | None:
    """A copy of the cached gold state for ``key``, if any."""
    if key is None or key not in _GOLD_CACHE:
        return None
    _GOLD_CACHE.move_to_end(key)
    gold_hash, user_hash, failures = _GOLD_CACHE[key]
    return gold_hash, user_hash, json.loads(json.dumps(failures))


def cache_gold(key: tuple | None, state: GoldState) -> None:
    if key is None:
        return
    _GOLD_CACHE[key] = (state[0], state[1], json.loads(json.dumps(state[2])))
    _GOLD_CACHE.move_to_end(key)
    if len(_GOLD_CACHE) > _GOLD_CACHE_SIZE:
        _GOLD_CACHE.popitem(last=False)


def _gold_state(task: Task, environment_factory: EnvironmentFactory, gold_sync: bool) -> GoldState:
    key = gold_cache_key(task, _factory_key(environment_factory), gold_sync=gold_sync)
    hit = cached_gold(key)
    if hit is not None:
        return hit
    gold = environment_factory()
    gold.apply_initial_state(task.initial_state)
    failures = replay_gold(gold, task, sync=gold_sync)
    result = (gold.get_db_hash(), gold.get_user_db_hash(), failures)
    cache_gold(key, result)
    return result


# Predicted states depend only on the data, the initial state and the mutating calls (with their
# recorded outputs, so replay mismatches are the same too): k trials that made the same writes,
# and every read-only episode, are replayed once. Not used when env assertions need the state.
_PRED_CACHE: "OrderedDict[tuple, tuple[str, str | None, list[dict[str, Any]]]]" = OrderedDict()


def _predicted_key(data_key: Any, messages: Sequence[_Message], task: Task, env_types: Any) -> tuple | None:
    if data_key is None:
        return None
    recorded = {m.tool_call_id: m.text for m in messages if isinstance(m, ToolMessage)}
    calls = tuple((who, c.name, c.function.arguments, recorded.get(c.id)) for c, who in tool_calls_of(messages)
                  if env_types(c.name, who))
    initial = task.initial_state.model_dump_json() if task.initial_state else ""
    return (data_key, initial, calls)


def check_db(messages: Sequence[_Message], task: Task, environment_factory: EnvironmentFactory,
             *, strict: bool = True, gold_sync: bool = False) -> DBResult:
    gold_hash, gold_user_hash, failures = _gold_state(task, environment_factory, gold_sync)
    needs_state = bool(task.evaluation_criteria and task.evaluation_criteria.env_assertions)
    key = None
    mutating = getattr(_data_of(environment_factory), "is_mutating_tool", None)
    if not needs_state and mutating is not None:
        key = _predicted_key(_factory_key(environment_factory), messages, task, mutating)
    predicted = None
    if key is not None and key in _PRED_CACHE:
        _PRED_CACHE.move_to_end(key)
        pred_hash, pred_user_hash, mismatches = _PRED_CACHE[key]
        mismatches = json.loads(json.dumps(mismatches))
    else:
        predicted = environment_factory()
        predicted.apply_initial_state(task.initial_state)
        mismatches = replay_trajectory(predicted, messages, strict=strict)
        pred_hash, pred_user_hash = predicted.get_db_hash(), predicted.get_user_db_hash()
        if key is not None:
            _PRED_CACHE[key] = (pred_hash, pred_user_hash, mismatches)
            if len(_PRED_CACHE) > _GOLD_CACHE_SIZE:
                _PRED_CACHE.popitem(last=False)
    user_match = gold_user_hash == pred_user_hash
    match = gold_hash == pred_hash and user_match
    check = DBCheck(db_match=match, db_reward=1.0 if match else 0.0, gold_hash=gold_hash, predicted_hash=pred_hash,
                    user_db_match=user_match if gold_user_hash is not None else None)
    return DBResult(check, predicted, failures, mismatches)


def _data_of(factory: EnvironmentFactory) -> Any:
    return getattr(factory, "__self__", None)
