"""Test support: a small retail data root built here, and scripted model clients (stand-ins for
outside model services, behind the real ModelClient interface)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from closedloop.messages import AssistantMessage, Turn, Usage, _Message
from closedloop.models.base import ModelClient

def _anchors() -> Path:
    """The real tau2 data: $TAU2_DATA_DIR, else ../shared/anchors beside the repository."""
    repo = Path(__file__).resolve().parents[3]
    for cand in (os.environ.get("TAU2_DATA_DIR"), repo.parent / "shared" / "anchors"):
        if cand and (Path(cand) / "tau2" / "domains" / "retail").is_dir():
            return Path(cand)
    return repo.parent / "shared" / "anchors"


ANCHORS = _anchors()


def _addr(zip_: str) -> dict[str, str]:
    return {"address1": "1 Main St", "address2": "", "city": "Springfield", "country": "USA", "state": "IL", "zip": zip_}


def mini_db() -> dict[str, Any]:
    variants = {
        "1001": {"item_id": "1001", "options": {"color": "red"}, "available": True, "price": 10.0},
        "1002": {"item_id": "1002", "options": {"color": "blue"}, "available": True, "price": 12.5},
        "1003": {"item_id": "1003", "options": {"color": "green"}, "available": False, "price": 11.0},
    }
    item = {"name": "Mug", "product_id": "900", "item_id": "1001", "price": 10.0, "options": {"color": "red"}}
    return {
        "products": {"900": {"name": "Mug", "product_id": "900", "variants": variants}},
        "users": {"ada_1": {
            "user_id": "ada_1", "name": {"first_name": "Ada", "last_name": "Lovelace"}, "address": _addr("60601"),
            "email": "ada@example.com",
            "payment_methods": {"gift_card_1": {"source": "gift_card", "id": "gift_card_1", "balance": 2.0},
                                "credit_card_1": {"source": "credit_card", "id": "credit_card_1", "brand": "visa",
                                                  "last_four": "4242"}},
            "orders": ["#W1", "#W2"]}},
        "orders": {
            "#W1": {"order_id": "#W1", "user_id": "ada_1", "address": _addr("60601"), "items": [item],
                    "status": "pending", "fulfillments": [],
                    "payment_history": [{"transaction_type": "payment", "amount": 10.0, "payment_method_id": "gift_card_1"}]},
            "#W2": {"order_id": "#W2", "user_id": "ada_1", "address": _addr("60601"), "items": [dict(item)],
                    "status": "delivered", "fulfillments": [{"tracking_id": ["T1"], "item_ids": ["1001"]}],
                    "payment_history": [{"transaction_type": "payment", "amount": 10.0, "payment_method_id": "credit_card_1"}]},
        },
    }


def make_task(task_id: str, actions: list[dict[str, Any]], *, basis: list[str] | None = None,
              communicate: list[str] | None = None, nl: list[str] | None = None,
              env_assertions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "id": task_id, "description": {"purpose": "test"}, "annotations": {"unknown": "ignored"},
        "user_scenario": {"persona": None, "instructions": {
            "domain": "retail", "reason_for_call": "I want to cancel order #W1.", "known_info": "You are Ada Lovelace.",
            "unknown_info": None, "task_instructions": "Be brief."}},
        "initial_state": None,
        "evaluation_criteria": {
            "actions": [{"action_id": f"{task_id}_{i}", **a} for i, a in enumerate(actions)],
            "communicate_info": communicate or [], "nl_assertions": nl,
            **({"env_assertions": env_assertions} if env_assertions else {}),
            **({"reward_basis": basis} if basis is not None else {})},
    }


CANCEL = {"name": "cancel_pending_order", "arguments": {"order_id": "#W1", "reason": "no longer needed"}}
LOOKUP = {"name": "get_order_details", "arguments": {"order_id": "#W1"}}


def mini_tasks() -> list[dict[str, Any]]:
    return [
        make_task("cancel", [LOOKUP, CANCEL], basis=["DB", "COMMUNICATE"], communicate=["10.0"]),
        make_task("cancel_nl", [CANCEL], basis=["DB", "NL_ASSERTION"], nl=["Agent cancels order #W1."]),
        make_task("cancel_action", [CANCEL], basis=["ACTION"]),
        make_task("noop", [LOOKUP], basis=["DB"]),
    ]


def write_root(root: Path, db: dict[str, Any], tasks: list[dict[str, Any]], split: dict[str, list[str]] | None = None) -> Path:
    folder = root / "tau2" / "domains" / "retail"
    folder.mkdir(parents=True)
    (folder / "db.json").write_text(json.dumps(db))
    (folder / "policy.md").write_text("# Retail policy\nBe helpful.")
    (folder / "tasks.json").write_text(json.dumps(tasks))
    if split is not None:
        (folder / "split_tasks.json").write_text(json.dumps(split))
    return root


class ScriptedClient(ModelClient):
    """Replies from a script: a list of strings/messages, or a function of the prompt messages."""

    spec = "scripted"

    def __init__(self, script: list[str | AssistantMessage] | Callable[[list[_Message]], str], *,
                 usage: Usage | None = None) -> None:
        self.script = script
        self.usage = usage or Usage()
        self.prompts: list[list[_Message]] = []

    async def generate(self, messages, tools=None, params=None, tool_choice=None) -> Turn:
        self.prompts.append(list(messages))
        if callable(self.script):
            reply: str | AssistantMessage = self.script(messages)
        else:
            if len(self.prompts) > len(self.script):
                raise AssertionError("scripted client ran out of replies")
            reply = self.script[len(self.prompts) - 1]
        msg = reply if isinstance(reply, AssistantMessage) else AssistantMessage(content=reply)
        return Turn(message=msg, model=self.spec, usage=self.usage)


def scripted_agent(outputs: list[AssistantMessage]):
    """An agent callable that returns the given messages in order and records what it saw."""
    seen: list[list[_Message]] = []

    async def agent(messages, tools):
        seen.append(list(messages))
        if len(seen) > len(outputs):
            raise AssertionError("scripted agent ran out of messages")
        return outputs[len(seen) - 1]

    agent.seen = seen  # type: ignore[attr-defined]
    return agent
