"""The retail toolkit: tau2's 16 agent tools, re-implemented here.

Tool names, argument names, return values (the touched record, or a string) and error messages
match tau2 1.0.x (``src/tau2/domains/retail/tools.py``) so that trajectories and DB hashes carry
over; descriptions are our own wording of the same contract. Where upstream revisions differ,
the per-item price update of ``modify_pending_order_items`` follows the revision that looks up
each new item's own variant (tau-bench v1 semantics).
"""

from __future__ import annotations

import json
import unicodedata

from closedloop.evals.tau.domains.base import Toolkit, is_tool
from closedloop.evals.tau.domains.retail.db import (GiftCard, Order, OrderPayment, PaymentMethod, Product,
                                                    RetailDB, User, UserAddress, Variant)

_CALC_CHARS = set("0123456789+-*/(). ")
_CANCEL_REASONS = {"no longer needed", "ordered by mistake"}


def fold_for_match(text: str) -> str:
    """Case- and accent-insensitive form (tau2 τ³: a spoken 'Vazquez' must find 'Vázquez')."""
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(c for c in decomposed if not unicodedata.combining(c)).casefold().strip()


class RetailTools(Toolkit):
    """Customer-service tools over one :class:`RetailDB`."""

    db: RetailDB

    # ------------------------------------------------------------------ lookups (not tools)

    def _get_order(self, order_id: str) -> Order:
        if order_id not in self.db.orders:
            raise ValueError("Order not found")
        return self.db.orders[order_id]

    def _get_user(self, user_id: str) -> User:
        if user_id not in self.db.users:
            raise ValueError("User not found")
        return self.db.users[user_id]

    def _get_product(self, product_id: str) -> Product:
        if product_id not in self.db.products:
            raise ValueError("Product not found")
        return self.db.products[product_id]

    def _get_variant(self, product_id: str, variant_id: str) -> Variant:
        product = self._get_product(product_id)
        if variant_id not in product.variants:
            raise ValueError("Variant not found")
        return product.variants[variant_id]

    def _get_payment_method(self, user_id: str, payment_method_id: str) -> PaymentMethod:
        user = self._get_user(user_id)
        if payment_method_id not in user.payment_methods:
            raise ValueError("Payment method not found")
        return user.payment_methods[payment_method_id]

    @staticmethod
    def _check_items_present(order: Order, item_ids: list[str], message: str | None) -> None:
        present = [item.item_id for item in order.items]
        for item_id in item_ids:
            if item_ids.count(item_id) > present.count(item_id):
                raise ValueError(message if message is not None else f"{item_id} not found")

    def _price_difference(self, order: Order, item_ids: list[str], new_item_ids: list[str], *,
                          distinct: bool) -> float:
        """Σ (new variant price − old item price), checking each swap as tau2 does (in its order)."""
        diff = 0.0
        for item_id, new_item_id in zip(item_ids, new_item_ids):
            if distinct and item_id == new_item_id:
                raise ValueError("The new item id should be different from the old item id")
            item = next((i for i in order.items if i.item_id == item_id), None)
            if item is None:
                raise ValueError(f"Item {item_id} not found")
            variant = self._get_variant(item.product_id, new_item_id)
            if not variant.available:
                raise ValueError(f"New item {new_item_id} not found or available")
            diff += variant.price - item.price
        return diff

    # ------------------------------------------------------------------ generic

    @is_tool(kind="generic")
    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression and return the result rounded to 2 decimals.

        Args:
            expression: The expression, such as '2 + 2'. Only numbers, + - * /, parentheses, dots and spaces are allowed.
        """
        if not all(ch in _CALC_CHARS for ch in expression):
            raise ValueError("Invalid characters in expression")
        return str(round(float(eval(expression, {"__builtins__": None}, {})), 2))  # noqa: S307 (charset-checked)

    @is_tool(kind="generic")
    def transfer_to_human_agents(self, summary: str) -> str:
        """Hand the user over to a human agent with a summary of the issue. Only do this if the user explicitly asks for a human, or if the policy and the available tools cannot resolve the issue.

        Args:
            summary: A summary of the user's issue.
        """
        return "Transfer successful"

    # ------------------------------------------------------------------ reads

    @is_tool(kind="read")
    def find_user_id_by_email(self, email: str) -> str:
        """Look up a user id by email address; errors when no user has that email.

        Args:
            email: The user's email, such as 'something@example.com'.
        """
        wanted = fold_for_match(email)
        for user_id, user in self.db.users.items():
            if fold_for_match(user.email) == wanted:
                return user_id
        raise ValueError("User not found")

    @is_tool(kind="read")
    def find_user_id_by_name_zip(self, first_name: str, last_name: str, zip: str) -> str:
        """Look up a user id by first name, last name and zip code; errors when nobody matches. Prefer find_user_id_by_email, and use this only when the user cannot give an email or is not found by it.

        Args:
            first_name: The customer's first name, such as 'John'.
            last_name: The customer's last name, such as 'Doe'.
            zip: The customer's zip code, such as '12345'.
        """
        first, last = fold_for_match(first_name), fold_for_match(last_name)
        for user_id, user in self.db.users.items():
            if (fold_for_match(user.name.first_name) == first and fold_for_match(user.name.last_name) == last
                    and user.address.zip == zip):
                return user_id
        raise ValueError("User not found")

    @is_tool(kind="read")
    def get_order_details(self, order_id: str) -> Order:
        """Return the status and details of an order.

        Args:
            order_id: The order id, such as '#W0000000'. Note the leading '#'.
        """
        return self._get_order(order_id)

    @is_tool(kind="read")
    def get_product_details(self, product_id: str) -> Product:
        """Return a product and the inventory of all its variants (items).

        Args:
            product_id: The product id, such as '6086499569'. A product id is not an item id.
        """
        return self._get_product(product_id)

    @is_tool(kind="read")
    def get_item_details(self, item_id: str) -> Variant:
        """Return the inventory details of one item (a product variant).

        Args:
            item_id: The item id, such as '6086499569'. An item id is not a product id.
        """
        for product in self.db.products.values():
            if item_id in product.variants:
                return product.variants[item_id]
        raise ValueError("Item not found")

    @is_tool(kind="read")
    def get_user_details(self, user_id: str) -> User:
        """Return a user's profile, payment methods and order ids.

        Args:
            user_id: The user id, such as 'sara_doe_496'.
        """
        return self._get_user(user_id)

    @is_tool(kind="read")
    def list_all_product_types(self) -> str:
        """List every product type (there are 50) as a JSON object mapping product name to product id, sorted by name. Each product type has several items with their own item ids and options."""
        return json.dumps({p.name: p.product_id for p in self.db.products.values()}, sort_keys=True)

    # ------------------------------------------------------------------ writes

    @is_tool(mutates=True, kind="write")
    def cancel_pending_order(self, order_id: str, reason: str) -> Order:
        """Cancel a pending order (processed or delivered orders cannot be cancelled). Explain the details and get an explicit yes from the user first. Payments are refunded: immediately to gift cards, otherwise within 5-7 business days. Returns the order after cancellation.

        Args:
            order_id: The order id, such as '#W0000000'. Note the leading '#'.
            reason: Either 'no longer needed' or 'ordered by mistake'.
        """
        order = self._get_order(order_id)
        if order.status != "pending":
            raise ValueError("Non-pending order cannot be cancelled")
        if reason not in _CANCEL_REASONS:
            raise ValueError("Invalid reason")
        refunds = []
        for payment in order.payment_history:
            refunds.append(OrderPayment(transaction_type="refund", amount=payment.amount,
                                        payment_method_id=payment.payment_method_id))
            user = self._get_user(order.user_id)
            method = self._get_payment_method(user.user_id, payment.payment_method_id)
            if isinstance(method, GiftCard):
                method.balance = round(method.balance + payment.amount, 2)
        order.status = "cancelled"
        order.cancel_reason = reason
        order.payment_history.extend(refunds)
        return order

    @is_tool(mutates=True, kind="write")
    def exchange_delivered_order_items(self, order_id: str, item_ids: list[str], new_item_ids: list[str],
                                       payment_method_id: str) -> Order:
        """Exchange items of a delivered order for other items of the same product. A delivered order can be returned or exchanged only once. Explain the details and get an explicit yes from the user first. Returns the order after the exchange request.

        Args:
            order_id: The order id, such as '#W0000000'. Note the leading '#'.
            item_ids: The item ids to exchange, each such as '1008292230'; duplicates allowed.
            new_item_ids: The replacement item ids, position by position, each of the same product as the item it replaces.
            payment_method_id: The payment method that pays or receives the price difference, such as 'gift_card_0000000' or 'credit_card_0000000'.
        """
        order = self._get_order(order_id)
        if order.status != "delivered":
            raise ValueError("Non-delivered order cannot be exchanged")
        for item_id in item_ids:
            self._check_items_present(order, [item_id] * item_ids.count(item_id), f"Number of {item_id} not found.")
        if len(item_ids) != len(new_item_ids):
            raise ValueError("The number of items to be exchanged should match.")
        diff = round(self._price_difference(order, item_ids, new_item_ids, distinct=False), 2)
        method = self._get_payment_method(order.user_id, payment_method_id)
        if isinstance(method, GiftCard) and method.balance < diff:
            raise ValueError("Insufficient gift card balance to pay for the price difference")
        order.status = "exchange requested"
        order.exchange_items = sorted(item_ids)
        order.exchange_new_items = sorted(new_item_ids)
        order.exchange_payment_method_id = payment_method_id
        order.exchange_price_difference = diff
        return order

    @is_tool(mutates=True, kind="write")
    def modify_pending_order_address(self, order_id: str, address1: str, address2: str, city: str, state: str,
                                     country: str, zip: str) -> Order:
        """Change the shipping address of a pending order. Explain the details and get an explicit yes from the user first. Returns the order after the change.

        Args:
            order_id: The order id, such as '#W0000000'. Note the leading '#'.
            address1: First address line, such as '123 Main St'.
            address2: Second address line, such as 'Apt 1' or ''.
            city: The city, such as 'San Francisco'.
            state: The state, such as 'CA'.
            country: The country, such as 'USA'.
            zip: The zip code, such as '12345'.
        """
        order = self._get_order(order_id)
        if "pending" not in order.status:
            raise ValueError("Non-pending order cannot be modified")
        order.address = UserAddress(address1=address1, address2=address2, city=city, state=state,
                                    country=country, zip=zip)
        return order

    @is_tool(mutates=True, kind="write")
    def modify_pending_order_items(self, order_id: str, item_ids: list[str], new_item_ids: list[str],
                                   payment_method_id: str) -> Order:
        """Swap items of a pending order for other items of the same product. This can be done only once per order. Explain the details and get an explicit yes from the user first. Returns the order after the change.

        Args:
            order_id: The order id, such as '#W0000000'. Note the leading '#'.
            item_ids: The item ids to change, each such as '1008292230'; duplicates allowed.
            new_item_ids: The replacement item ids, position by position, each of the same product as the item it replaces.
            payment_method_id: The payment method that pays or receives the price difference, such as 'gift_card_0000000' or 'credit_card_0000000'.
        """
        order = self._get_order(order_id)
        if order.status != "pending":
            raise ValueError("Non-pending order cannot be modified")
        self._check_items_present(order, item_ids, None)
        if len(item_ids) != len(new_item_ids):
            raise ValueError("The number of items to be exchanged should match")
        diff = self._price_difference(order, item_ids, new_item_ids, distinct=True)
        method = self._get_payment_method(order.user_id, payment_method_id)
        if isinstance(method, GiftCard) and method.balance < diff:
            raise ValueError("Insufficient gift card balance to pay for the new item")
        order.payment_history.append(OrderPayment(transaction_type="payment" if diff > 0 else "refund",
                                                  amount=abs(diff), payment_method_id=payment_method_id))
        if isinstance(method, GiftCard):
            method.balance = round(method.balance - diff, 2)
        for item_id, new_item_id in zip(item_ids, new_item_ids):
            item = next((i for i in order.items if i.item_id == item_id), None)
            if item is None:
                raise ValueError(f"Item {item_id} not found")
            variant = self._get_variant(item.product_id, new_item_id)
            item.item_id = new_item_id
            item.price = variant.price
            item.options = variant.options
        order.status = "pending (item modified)"
        return order

    @is_tool(mutates=True, kind="write")
    def modify_pending_order_payment(self, order_id: str, payment_method_id: str) -> Order:
        """Change the payment method of a pending order. Explain the details and get an explicit yes from the user first. Returns the order after the change.

        Args:
            order_id: The order id, such as '#W0000000'. Note the leading '#'.
            payment_method_id: The new payment method, such as 'gift_card_0000000' or 'credit_card_0000000'.
        """
        order = self._get_order(order_id)
        if "pending" not in order.status:
            raise ValueError("Non-pending order cannot be modified")
        method = self._get_payment_method(order.user_id, payment_method_id)
        history = order.payment_history
        if len(history) != 1 or history[0].transaction_type != "payment":
            raise ValueError("There should be exactly one payment for a pending order")
        old_method_id = history[0].payment_method_id
        if old_method_id == payment_method_id:
            raise ValueError("The new payment method should be different from the current one")
        amount = history[0].amount
        if isinstance(method, GiftCard) and method.balance < amount:
            raise ValueError("Insufficient gift card balance to pay for the order")
        history.extend([
            OrderPayment(transaction_type="payment", amount=amount, payment_method_id=payment_method_id),
            OrderPayment(transaction_type="refund", amount=amount, payment_method_id=old_method_id),
        ])
        if isinstance(method, GiftCard):
            method.balance = round(method.balance - amount, 2)
        old_method = self._get_payment_method(order.user_id, old_method_id)
        if isinstance(old_method, GiftCard):
            old_method.balance = round(old_method.balance + amount, 2)
        return order

    @is_tool(mutates=True, kind="write")
    def modify_user_address(self, user_id: str, address1: str, address2: str, city: str, state: str, country: str,
                            zip: str) -> User:
        """Change a user's default address. Explain the details and get an explicit yes from the user first. Returns the user after the change.

        Args:
            user_id: The user id, such as 'sara_doe_496'.
            address1: First address line, such as '123 Main St'.
            address2: Second address line, such as 'Apt 1' or ''.
            city: The city, such as 'San Francisco'.
            state: The state, such as 'CA'.
            country: The country, such as 'USA'.
            zip: The zip code, such as '12345'.
        """
        user = self._get_user(user_id)
        user.address = UserAddress(address1=address1, address2=address2, city=city, state=state, country=country,
                                   zip=zip)
        return user

    @is_tool(mutates=True, kind="write")
    def return_delivered_order_items(self, order_id: str, item_ids: list[str], payment_method_id: str) -> Order:
        """Request the return of some items of a delivered order; the status becomes 'return requested' and the user gets an email on how to send them back. Explain the details and get an explicit yes from the user first. Returns the order after the request.

        Args:
            order_id: The order id, such as '#W0000000'. Note the leading '#'.
            item_ids: The item ids to return, each such as '1008292230'; duplicates allowed.
            payment_method_id: Where the refund goes: the original payment method or a gift card, such as 'gift_card_0000000' or 'credit_card_0000000'.
        """
        order = self._get_order(order_id)
        if order.status != "delivered":
            raise ValueError("Non-delivered order cannot be returned")
        user = self._get_user(order.user_id)
        method = self._get_payment_method(user.user_id, payment_method_id)
        if not isinstance(method, GiftCard) and payment_method_id != order.payment_history[0].payment_method_id:
            raise ValueError("Payment method should be the original payment method")
        self._check_items_present(order, item_ids, "Some item not found")
        order.status = "return requested"
        order.return_items = sorted(item_ids)
        order.return_payment_method_id = payment_method_id
        return order
