"""The retail database as typed records.

Field names and optional fields follow tau2's ``RetailDB`` so that ``model_dump`` (and therefore
the DB hash) has the same shape as upstream: orders gain ``None`` defaults for the fields that
cancellations, returns and exchanges add later.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, Field

from closedloop.evals.tau.domains.base import TauDB


class Variant(BaseModel):
    item_id: str
    options: dict[str, str]
    available: bool
    price: float


class Product(BaseModel):
    name: str
    product_id: str
    variants: dict[str, Variant]


class UserName(BaseModel):
    first_name: str
    last_name: str


class UserAddress(BaseModel):
    address1: str
    address2: str
    city: str
    country: str
    state: str
    zip: str


class CreditCard(BaseModel):
    source: Literal["credit_card"] = "credit_card"
    id: str
    brand: str
    last_four: str


class Paypal(BaseModel):
    source: Literal["paypal"] = "paypal"
    id: str


class GiftCard(BaseModel):
    source: Literal["gift_card"] = "gift_card"
    id: str
    balance: float


PaymentMethod = Annotated[Union[CreditCard, Paypal, GiftCard], Field(discriminator="source")]


class User(BaseModel):
    user_id: str
    name: UserName
    address: UserAddress
    email: str
    payment_methods: dict[str, PaymentMethod]
    orders: list[str]


class OrderFulfillment(BaseModel):
    tracking_id: list[str]
    item_ids: list[str]


class OrderItem(BaseModel):
    name: str
    product_id: str
    item_id: str
    price: float
    options: dict[str, str]


class OrderPayment(BaseModel):
    transaction_type: Literal["payment", "refund"]
    amount: float
    payment_method_id: str


class Order(BaseModel):
    order_id: str
    user_id: str
    address: UserAddress
    items: list[OrderItem]
    status: str
    fulfillments: list[OrderFulfillment]
    payment_history: list[OrderPayment]
    cancel_reason: str | None = None
    exchange_items: list[str] | None = None
    exchange_new_items: list[str] | None = None
    exchange_payment_method_id: str | None = None
    exchange_price_difference: float | None = None
    return_items: list[str] | None = None
    return_payment_method_id: str | None = None


class RetailDB(TauDB):
    """Products, users and orders, each keyed by id (the layout of ``db.json``)."""

    products: dict[str, Product]
    users: dict[str, User]
    orders: dict[str, Order]
