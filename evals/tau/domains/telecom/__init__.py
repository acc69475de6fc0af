"""The telecom domain (tau2 ``telecom``): dual control. The agent manages the account (lines,
roaming, bills); the user acts on their own phone through user tools (airplane mode, APN,
data); after every step the two sides are reconciled (tau2 ``TelecomEnvironment.sync_tools``).

The policy is tau2's composition: ``main_policy.md`` and ``tech_support_manual.md`` wrapped in
``<main_policy>`` / ``<tech_support_policy>``. Ported from tau2-bench (MIT License, Copyright (c)
2025 Sierra Research).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from closedloop.evals.tau.domains.registry import Domain
from closedloop.evals.tau.domains.telecom.db import LineStatus, TelecomDB
from closedloop.evals.tau.domains.telecom.tools import TelecomTools
from closedloop.evals.tau.domains.telecom.user_db import PaymentRequest, TelecomUserDB
from closedloop.evals.tau.domains.telecom.user_tools import TelecomUserTools


def telecom_policy(folder: Path) -> str:
    main = (folder / "main_policy.md").read_text()
    tech = (folder / "tech_support_manual.md").read_text()
    return "<main_policy>\n" + main + "\n</main_policy>\n" + "<tech_support_policy>\n" + tech + "\n</tech_support_policy>"


def sync_tools(env: Any) -> None:
    """tau2 ``TelecomEnvironment.sync_tools``, line for line."""
    tools, user_tools = env.toolkit, env.user_toolkit
    if user_tools is None or user_tools.db.surroundings.phone_number is None:
        return
    phone_number = user_tools.db.surroundings.phone_number
    line = tools._get_line_by_phone(phone_number)
    if line is None:
        raise ValueError(f"Wrong scenario, line not found for phone number: {phone_number}")
    user_tools.db.surroundings.line_active = line.status == LineStatus.ACTIVE
    user_tools.db.surroundings.roaming_allowed = bool(line.roaming_enabled)
    plan = tools._get_plan_by_id(line.plan_id)
    if plan is None:
        raise ValueError(f"Wrong scenario, invalid plan id ({line.plan_id}) for the phone number {phone_number}")
    user_tools.db.surroundings.mobile_data_usage_exceeded = (
        line.data_used_gb >= plan.data_limit_gb + line.data_refueling_gb)
    current = user_tools.db.surroundings.payment_request
    if current is not None and current.paid:
        tools._set_bill_to_paid(current.bill_id)
        user_tools.db.surroundings.payment_request = None
    if user_tools.db.surroundings.payment_request is None:
        customer = tools.get_customer_by_phone(phone_number)
        bills = tools._get_bills_awaiting_payment(customer)
        if len(bills) != 0:
            bill = bills[0]
            user_tools.db.surroundings.payment_request = PaymentRequest(bill_id=bill.bill_id, amount_due=bill.total_due)


TELECOM = Domain(name="telecom", db_model=TelecomDB, toolkit=TelecomTools,
                  user_db_model=TelecomUserDB, user_toolkit=TelecomUserTools,
                  policy_file="main_policy.md", policy_text=telecom_policy, sync_tools=sync_tools)

__all__ = ["TELECOM", "TelecomTools", "TelecomUserTools", "TelecomDB", "TelecomUserDB", "sync_tools", "telecom_policy"]
