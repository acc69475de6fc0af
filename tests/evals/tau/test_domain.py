"""Loading domains and data, the retail tools' contract, the registry."""

from __future__ import annotations

import json

import pytest

from closedloop.evals.tau import TauDataError, load_domain, resolve_data_root
from closedloop.evals.tau.domains import Domain, available_domains, get_domain, register_domain
from closedloop.evals.tau.domains.base import TauDB, Toolkit, is_tool
from closedloop.messages import ToolCall
from closedloop.tool import Tool

RETAIL_TOOLS = {
    "calculate", "cancel_pending_order", "exchange_delivered_order_items", "find_user_id_by_email",
    "find_user_id_by_name_zip", "get_item_details", "get_order_details", "get_product_details", "get_user_details",
    "list_all_product_types", "modify_pending_order_address", "modify_pending_order_items",
    "modify_pending_order_payment", "modify_user_address", "return_delivered_order_items", "transfer_to_human_agents",
}
WRITES = {"cancel_pending_order", "exchange_delivered_order_items", "modify_pending_order_address",
          "modify_pending_order_items", "modify_pending_order_payment", "modify_user_address",
          "return_delivered_order_items"}


def test_anchor_retail_loads(anchors_retail):
    train = anchors_retail.load_tasks("train")
    assert len(train) == 74 and len(train.sha256) == 64
    assert all(t.source_sha256 == train.sha256 for t in train.tasks)
    env = anchors_retail.make_environment()
    assert {t.name for t in env.tools} == RETAIL_TOOLS
    assert {t.name for t in env.tools if t.mutates} == WRITES
    assert len(env.db.users) == 500 and len(env.db.orders) == 1000 and len(env.db.products) == 50
    assert "<policy>" not in env.policy and len(env.policy) > 1000
    # every gold action names a real tool with arguments its schema accepts
    for task in train.tasks:
        for action in task.evaluation_criteria.actions:
            env.tools.get(action.name).validate(action.arguments)


def test_data_root_resolution(mini_root, monkeypatch, tmp_path):
    monkeypatch.setenv("TAU2_DATA_DIR", str(mini_root))
    assert resolve_data_root() == mini_root
    assert len(load_domain("retail").load_tasks("train")) == 2
    monkeypatch.delenv("TAU2_DATA_DIR")
    with pytest.raises(TauDataError, match="TAU2_DATA_DIR"):
        resolve_data_root()
    with pytest.raises(TauDataError, match="not a τ data root"):
        resolve_data_root(tmp_path / "nowhere")


def test_splits_and_unknown_keys(mini):
    assert [t.id for t in mini.load_tasks("train").tasks] == ["cancel", "noop"]
    assert len(mini.load_tasks("base")) == 4  # base = everything when the split file does not define it
    with pytest.raises(TauDataError, match="no split 'test'"):
        mini.load_tasks("test")
    task = mini.load_tasks(task_ids=["cancel_nl"]).tasks[0]
    assert "annotations" not in task.model_dump()  # unknown keys are dropped, not rejected
    assert [b.value for b in task.reward_basis] == ["DB", "NL_ASSERTION"]
    assert "Instructions:\n\tDomain: retail\n\tReason for call:\n\t\tI want to cancel order #W1." in str(task.user_scenario)


def test_tool_results_and_errors_are_tau2_shaped(mini):
    env = mini.make_environment()
    ok = env.run_tool_call(ToolCall.make("get_order_details", {"order_id": "#W1"}))
    assert ok.error is None and json.loads(ok.text)["status"] == "pending"
    missing = env.run_tool_call(ToolCall.make("get_order_details", {"order_id": "W1"}))
    assert missing.text == "Error: Order not found" and missing.error == "Order not found"
    unknown = env.run_tool_call(ToolCall.make("refund_everything", {}))
    assert unknown.text == "Error: Tool 'refund_everything' not found."
    bad_args = env.run_tool_call(ToolCall.make("cancel_pending_order", {"order_id": "#W1"}))
    assert bad_args.error and "reason" in bad_args.text
    reason = env.run_tool_call(ToolCall.make("cancel_pending_order", {"order_id": "#W1", "reason": "meh"}))
    assert reason.text == "Error: Invalid reason"
    assert env.run_tool_call(ToolCall.make("calculate", {"expression": "(10 + 2.5) / 3"})).text == "4.17"
    assert env.run_tool_call(ToolCall.make("calculate", {"expression": "__import__('os')"})).text == \
        "Error: Invalid characters in expression"
    assert env.make_tool_call("find_user_id_by_name_zip", first_name="ADA", last_name="lovelace", zip="60601") == "ada_1"
    assert isinstance(env.tools.get("get_user_details"), Tool)


def test_write_semantics_and_fresh_environments(mini):
    env = mini.make_environment()
    pristine = env.get_db_hash()
    order = env.make_tool_call("cancel_pending_order", order_id="#W1", reason="ordered by mistake")
    assert order.status == "cancelled" and order.payment_history[-1].transaction_type == "refund"
    assert env.db.users["ada_1"].payment_methods["gift_card_1"].balance == 12.0  # gift card refunded at once
    with pytest.raises(ValueError, match="Non-pending order cannot be cancelled"):
        env.make_tool_call("cancel_pending_order", order_id="#W1", reason="ordered by mistake")
    assert env.get_db_hash() != pristine
    assert mini.make_environment().get_db_hash() == pristine  # environments never share state
    other = mini.make_environment()
    with pytest.raises(ValueError, match="Insufficient gift card balance"):
        other.make_tool_call("modify_pending_order_items", order_id="#W1", item_ids=["1001"], new_item_ids=["1002"],
                             payment_method_id="gift_card_1")
    changed = other.make_tool_call("modify_pending_order_items", order_id="#W1", item_ids=["1001"],
                                   new_item_ids=["1002"], payment_method_id="credit_card_1")
    assert changed.items[0].price == 12.5 and changed.status == "pending (item modified)"
    with pytest.raises(ValueError, match="New item 1003 not found or available"):
        mini.make_environment().make_tool_call("exchange_delivered_order_items", order_id="#W2", item_ids=["1001"],
                                               new_item_ids=["1003"], payment_method_id="credit_card_1")


class CounterDB(TauDB):
    count: int = 0


class CounterTools(Toolkit):
    db: CounterDB

    @is_tool(mutates=True, kind="write")
    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.db.count += by
        return self.db.count

    def assert_count(self, value: int) -> bool:
        return self.db.count == value


def test_registering_a_domain_needs_no_core_edit(tmp_path):
    domain = register_domain(Domain(name="counter_test", db_model=CounterDB, toolkit=CounterTools), replace=True)
    assert get_domain("counter_test") is domain and "counter_test" in available_domains()
    folder = tmp_path / "tau2" / "domains" / "counter_test"
    folder.mkdir(parents=True)
    (folder / "db.json").write_text('{"count": 1}')
    (folder / "tasks.json").write_text("[]")
    env = load_domain("counter_test", tmp_path).make_environment()
    assert env.make_tool_call("increment", by=2) == 3 and env.policy == ""
    with pytest.raises(KeyError, match="no τ domain named 'nope'"):
        get_domain("nope")


class RequestorTools(Toolkit):
    db: CounterDB

    @is_tool(kind="read")
    def whoami(self, requestor: str) -> str:
        """Echo who asked.

        Args:
            requestor: Who asks.
        """
        return requestor


def test_a_tool_parameter_named_like_tau2s_dispatcher_is_refused_when_the_toolkit_is_built():
    """tau2 calls ``make_tool_call(tool_name, requestor=..., **arguments)``: no call could reach
    such a tool there, so a domain that declares one fails at once, with the reason."""
    with pytest.raises(ValueError, match="'whoami' has a parameter named 'requestor'.*rename it"):
        RequestorTools(CounterDB())


def test_airline_list_arguments_are_coerced_as_tau2_does():
    """tau2's tools get the raw JSON kwargs and turn a list of objects into models; any other list is
    used as given, so even its objects fail at their first use, with Python's own error text."""
    from pathlib import Path

    data = load_domain("airline", Path(__file__).parent / "fixtures", tau2_source=False)
    env = data.make_environment()
    passengers = [{"first_name": "Chen", "last_name": "Lee", "dob": "1967-12-12"}]
    ok = env.run_tool_call(ToolCall.make("update_reservation_passengers",
                                         {"reservation_id": "JW6LEQ", "passengers": passengers}))
    assert ok.error is None and json.loads(ok.text)["passengers"] == passengers
    mixed = env.run_tool_call(ToolCall.make("update_reservation_flights", {
        "reservation_id": "JW6LEQ", "cabin": "business", "payment_id": "credit_card_4938634",
        "flights": [{"flight_number": "HAT147", "date": "2024-05-26"}, "HAT112"]}))
    assert mixed.text == "Error: 'dict' object has no attribute 'flight_number'"
    incomplete = env.run_tool_call(ToolCall.make("update_reservation_passengers",
                                                 {"reservation_id": "JW6LEQ", "passengers": [{"first_name": "Chen"}]}))
    assert incomplete.error is not None and "validation errors for Passenger" in incomplete.text
