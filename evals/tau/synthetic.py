"""A small generated retail domain in the τ-bench data layout, seeded and offline.

Why: the real retail data (500 users, 1000 orders, a long policy, NL-graded tasks) is large for
training loops on two CPU cores and cannot be regenerated with more or fewer tasks. This writes
``<out>/tau2/domains/retail/{db.json,policy.md,tasks.json,split_tasks.json}`` with the real
retail DB schema (products with variants, users with payment methods, orders with items,
fulfillments and payment history), so ``closedloop eval tau --data-dir <out>``, the gym
environment and the trainers use it unchanged with the existing retail toolkit.

Each task is one customer request with gold actions: authenticate (by email or by name + zip),
look up what the request needs, then one write: cancel a pending order, return delivered items,
exchange a delivered item for another variant, change a pending order's address or payment
method, or change the user's default address. Every gold write is replayed through the real
retail toolkit at generation time and must succeed and change the DB, so the gold-replay oracle
scores every task with ``db_match`` true. Tasks are graded on ``DB`` only (no judge needed).

Command line::

    python -m closedloop.evals.tau.synthetic OUT_DIR --users 20 --seed 0 [--tasks N] [--products P]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from closedloop.evals.tau.domains.retail.db import RetailDB
from closedloop.evals.tau.domains.retail.tools import RetailTools

__all__ = ["SyntheticRetail", "generate_retail", "write_retail", "GenerationError", "TASK_KINDS", "main"]

_COLORS = ["red", "blue", "green", "black", "white", "grey"]
# name -> (option space, price range)
PRODUCTS: list[tuple[str, dict[str, list[str]], tuple[float, float]]] = [
    ("T-Shirt", {"color": _COLORS, "size": ["S", "M", "L", "XL"], "material": ["cotton", "polyester"]}, (18, 60)),
    ("Mug", {"capacity": ["250ml", "350ml", "500ml"], "color": _COLORS, "material": ["ceramic", "glass"]}, (8, 30)),
    ("Water Bottle", {"capacity": ["500ml", "750ml", "1000ml"], "material": ["plastic", "stainless steel", "glass"],
                      "color": _COLORS}, (12, 60)),
    ("Desk Lamp", {"color": ["black", "white", "silver"], "brightness": ["low", "medium", "high"],
                   "power source": ["AC adapter", "USB", "battery"]}, (30, 200)),
    ("Backpack", {"color": _COLORS, "size": ["small", "medium", "large"], "material": ["nylon", "leather", "polyester"]},
     (40, 250)),
    ("Headphones", {"type": ["over-ear", "on-ear", "in-ear"], "connectivity": ["wired", "wireless"],
                    "color": ["black", "white", "blue"]}, (50, 400)),
    ("Sneakers", {"size": ["8", "9", "10", "11"], "color": _COLORS, "material": ["leather", "synthetic", "canvas"]},
     (50, 200)),
    ("Electric Kettle", {"capacity": ["1L", "1.5L", "2L"], "material": ["plastic", "stainless steel", "glass"],
                         "color": ["black", "white", "silver"]}, (25, 160)),
    ("Wristwatch", {"strap material": ["leather", "metal", "silicone"], "dial color": ["black", "white", "blue"]},
     (80, 600)),
    ("Notebook", {"size": ["A5", "A4"], "cover type": ["hard cover", "soft cover"], "pages": ["100", "200"]}, (5, 25)),
]
_FIRST = ["Ada", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jade", "Kofi", "Lena", "Mateo",
          "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara", "Uma", "Victor", "Wei", "Yara", "Zane"]
_LAST = ["Abbott", "Baker", "Costa", "Diaz", "Evans", "Fischer", "Garcia", "Hughes", "Ito", "Jensen", "Khan", "Lopez",
         "Moreau", "Nguyen", "Okafor", "Patel", "Rossi", "Silva", "Tanaka", "Weber"]
_STREETS = ["Main Street", "Oak Avenue", "Pine Road", "Maple Lane", "Cedar Court", "Elm Street", "Hill Drive",
            "Lake View", "River Road", "Sunset Boulevard"]
_CITIES = [("Austin", "TX", "787"), ("Boston", "MA", "021"), ("Chicago", "IL", "606"), ("Denver", "CO", "802"),
           ("Seattle", "WA", "981"), ("Portland", "OR", "972"), ("Phoenix", "AZ", "850"), ("Miami", "FL", "331")]
_CARD_BRANDS = ["visa", "mastercard", "amex"]
_STATUSES = (["pending", "delivered", "processed", "cancelled"], [0.4, 0.35, 0.1, 0.15])
TASK_KINDS = ("cancel", "return", "exchange", "modify_order_address", "modify_order_payment", "modify_user_address")
_CANCEL_REASONS = ["no longer needed", "ordered by mistake"]

POLICY = """# Retail agent policy (generated domain)

You are a customer service agent for an online shop. You can help a user to:

- cancel a pending order, or change its shipping address or payment method;
- return or exchange items of a delivered order;
- change their default address;
- look up their profile, orders and the shop's products.

Authenticate the user first, by email or by first name, last name and zip code, even if they give
their user id. Help only that user.

Before any action that changes the database (cancel, modify, return, exchange), list the details
and get an explicit "yes" from the user.

- A pending order can be cancelled with the reason "no longer needed" or "ordered by mistake".
  Processed, delivered and cancelled orders cannot be cancelled.
- A refund for a return goes to the original payment method or to a gift card of the user.
- An exchange swaps an item for another available item of the same product; the price difference
  is paid with, or refunded to, a payment method of the user. A gift card must cover a payment.
- A pending order's payment method can be changed to another method of the user that covers
  the amount.

Make one tool call at a time, do not invent information, and transfer to a human agent only when
the request cannot be handled with these tools.
"""


class GenerationError(RuntimeError):
    """The generator could not build a valid domain with these parameters."""


@dataclass
class SyntheticRetail:
    """A generated domain: the four files' contents."""

    db: dict[str, Any]
    policy: str
    tasks: list[dict[str, Any]]
    split: dict[str, list[str]]


class _Ids:
    """Random numeric ids, unique within one domain."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def digits(self, n: int) -> str:
        while True:
            value = str(self.rng.randint(10 ** (n - 1), 10 ** n - 1))
            if value not in self.used:
                self.used.add(value)
                return value


def _address(rng: random.Random) -> dict[str, str]:
    city, state, prefix = rng.choice(_CITIES)
    return {"address1": f"{rng.randint(1, 999)} {rng.choice(_STREETS)}",
            "address2": rng.choice(["", f"Suite {rng.randint(100, 999)}", f"Apt {rng.randint(1, 40)}"]),
            "city": city, "country": "USA", "state": state, "zip": f"{prefix}{rng.randint(0, 99):02d}"}


def _products(rng: random.Random, ids: _Ids, count: int) -> dict[str, Any]:
    products = {}
    for name, space, (lo, hi) in PRODUCTS[:count]:
        pid = ids.digits(10)
        keys = list(space)
        combos = [dict(zip(keys, vals)) for vals in _product(*(space[k] for k in keys))]
        chosen = rng.sample(combos, min(len(combos), rng.randint(4, 8)))
        variants = {}
        for options in chosen:
            iid = ids.digits(10)
            variants[iid] = {"item_id": iid, "options": options, "available": rng.random() < 0.85,
                             "price": round(rng.uniform(lo, hi), 2)}
        products[pid] = {"name": name, "product_id": pid, "variants": variants}
    return products


def _product(*lists: list[str]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = [()]
    for values in lists:
        out = [t + (v,) for t in out for v in values]
    return out


def _users(rng: random.Random, ids: _Ids, count: int) -> dict[str, Any]:
    users: dict[str, Any] = {}
    seen_names: set[tuple[str, str, str]] = set()
    while len(users) < count:
        first, last = rng.choice(_FIRST), rng.choice(_LAST)
        address = _address(rng)
        if (first, last, address["zip"]) in seen_names:
            continue  # find_user_id_by_name_zip must identify one user
        seen_names.add((first, last, address["zip"]))
        uid = f"{first.lower()}_{last.lower()}_{ids.digits(4)}"
        methods: dict[str, Any] = {}
        if rng.random() < 0.8:
            mid = f"credit_card_{ids.digits(7)}"
            methods[mid] = {"source": "credit_card", "id": mid, "brand": rng.choice(_CARD_BRANDS),
                            "last_four": f"{rng.randint(0, 9999):04d}"}
        if rng.random() < 0.5:
            mid = f"paypal_{ids.digits(7)}"
            methods[mid] = {"source": "paypal", "id": mid}
        if rng.random() < 0.5 or not methods:
            mid = f"gift_card_{ids.digits(7)}"
            methods[mid] = {"source": "gift_card", "id": mid, "balance": float(rng.randint(0, 300))}
        users[uid] = {"user_id": uid, "name": {"first_name": first, "last_name": last}, "address": address,
                      "email": f"{first.lower()}.{last.lower()}{ids.digits(4)}@example.com",
                      "payment_methods": methods, "orders": []}
    return users


def _orders(rng: random.Random, ids: _Ids, users: dict[str, Any], products: dict[str, Any]) -> dict[str, Any]:
    orders: dict[str, Any] = {}
    for uid, user in users.items():
        for _ in range(rng.randint(1, 3)):
            oid = f"#W{ids.digits(7)}"
            items = []
            for pid in rng.sample(sorted(products), rng.randint(1, min(3, len(products)))):
                product = products[pid]
                variant = product["variants"][rng.choice(sorted(product["variants"]))]
                items.append({"name": product["name"], "product_id": pid, "item_id": variant["item_id"],
                              "price": variant["price"], "options": dict(variant["options"])})
            status = rng.choices(*_STATUSES)[0]
            total = round(sum(i["price"] for i in items), 2)
            method = rng.choice(sorted(user["payment_methods"]))
            history = [{"transaction_type": "payment", "amount": total, "payment_method_id": method}]
            if status == "cancelled":
                history.append({"transaction_type": "refund", "amount": total, "payment_method_id": method})
            fulfillments = [] if status in ("pending", "cancelled") else \
                [{"tracking_id": [ids.digits(12)], "item_ids": [i["item_id"] for i in items]}]
            orders[oid] = {"order_id": oid, "user_id": uid, "address": dict(user["address"]), "items": items,
                           "status": status, "fulfillments": fulfillments, "payment_history": history}
            user["orders"].append(oid)
    return orders


# --------------------------------------------------------------------------- tasks


def _auth(rng: random.Random, user: dict[str, Any]) -> tuple[dict[str, Any], str]:
    name = user["name"]
    if rng.random() < 0.5:
        return ({"name": "find_user_id_by_email", "arguments": {"email": user["email"]}},
                f"You are {name['first_name']} {name['last_name']}; your email is {user['email']}.")
    return ({"name": "find_user_id_by_name_zip", "arguments": {"first_name": name["first_name"],
                                                                "last_name": name["last_name"],
                                                                "zip": user["address"]["zip"]}},
            f"You are {name['first_name']} {name['last_name']} in zip code {user['address']['zip']}.")


def _get_order(oid: str) -> dict[str, Any]:
    return {"name": "get_order_details", "arguments": {"order_id": oid}}


def _affordable(user: dict[str, Any], amount: float, exclude: str | None = None) -> list[str]:
    """Payment methods of the user that can pay ``amount`` (gift cards need the balance)."""
    out = []
    for mid, m in sorted(user["payment_methods"].items()):
        if mid == exclude:
            continue
        if m["source"] != "gift_card" or m["balance"] >= amount:
            out.append(mid)
    return out


TaskBuilder = Callable[[random.Random, dict[str, Any], dict[str, Any]], tuple[list[dict[str, Any]], str] | None]


def _cancel(rng, db, order):
    if order["status"] != "pending":
        return None
    reason = rng.choice(_CANCEL_REASONS)
    return ([_get_order(order["order_id"]), {"name": "cancel_pending_order",
                                             "arguments": {"order_id": order["order_id"], "reason": reason}}],
            f"You want to cancel your pending order {order['order_id']} because it was {reason}."
            if reason == "ordered by mistake" else
            f"You want to cancel your pending order {order['order_id']} because you no longer need it.")


def _return(rng, db, order):
    if order["status"] != "delivered":
        return None
    items = rng.sample(order["items"], rng.randint(1, len(order["items"])))
    user = db["users"][order["user_id"]]
    original = order["payment_history"][0]["payment_method_id"]
    gift = [m for m, v in sorted(user["payment_methods"].items()) if v["source"] == "gift_card"]
    method = rng.choice([original] + gift)
    where = "your original payment method" if method == original else f"your gift card {method}"
    names = " and the ".join(i["name"].lower() for i in items)
    return ([_get_order(order["order_id"]), {"name": "return_delivered_order_items", "arguments": {
        "order_id": order["order_id"], "item_ids": sorted(i["item_id"] for i in items), "payment_method_id": method}}],
        f"You want to return the {names} from your delivered order {order['order_id']}, "
        f"with the refund going to {where}.")


def _exchange(rng, db, order):
    if order["status"] != "delivered":
        return None
    item = rng.choice(order["items"])
    product = db["products"][item["product_id"]]
    others = [v for iid, v in sorted(product["variants"].items()) if iid != item["item_id"] and v["available"]]
    if not others:
        return None
    new = rng.choice(others)
    user = db["users"][order["user_id"]]
    methods = _affordable(user, round(new["price"] - item["price"], 2))
    if not methods:
        return None
    method = rng.choice(methods)
    wanted = ", ".join(f"{k} {v}" for k, v in new["options"].items())
    return ([_get_order(order["order_id"]), {"name": "get_product_details",
                                             "arguments": {"product_id": item["product_id"]}},
             {"name": "exchange_delivered_order_items", "arguments": {
                 "order_id": order["order_id"], "item_ids": [item["item_id"]], "new_item_ids": [new["item_id"]],
                 "payment_method_id": method}}],
            f"You want to exchange the {item['name'].lower()} from your delivered order {order['order_id']} for "
            f"the one with {wanted}, settling any price difference with {method}.")


def _modify_order_address(rng, db, order):
    if order["status"] != "pending":
        return None
    new = _address(rng)
    return ([_get_order(order["order_id"]), {"name": "modify_pending_order_address",
                                             "arguments": {"order_id": order["order_id"], **new}}],
            f"You want your pending order {order['order_id']} shipped to {new['address1']}"
            f"{', ' + new['address2'] if new['address2'] else ''}, {new['city']}, {new['state']} {new['zip']}, "
            f"{new['country']}.")


def _modify_order_payment(rng, db, order):
    if order["status"] != "pending" or len(order["payment_history"]) != 1:
        return None
    user = db["users"][order["user_id"]]
    current = order["payment_history"][0]
    methods = _affordable(user, current["amount"], exclude=current["payment_method_id"])
    if not methods:
        return None
    method = rng.choice(methods)
    return ([{"name": "get_user_details", "arguments": {"user_id": order["user_id"]}}, _get_order(order["order_id"]),
             {"name": "modify_pending_order_payment",
              "arguments": {"order_id": order["order_id"], "payment_method_id": method}}],
            f"You want to pay for your pending order {order['order_id']} with {method} instead.")


def _modify_user_address(rng, db, order):
    new = _address(rng)
    uid = order["user_id"]
    return ([{"name": "get_user_details", "arguments": {"user_id": uid}},
             {"name": "modify_user_address", "arguments": {"user_id": uid, **new}}],
            f"You moved and want your default address changed to {new['address1']}"
            f"{', ' + new['address2'] if new['address2'] else ''}, {new['city']}, {new['state']} {new['zip']}, "
            f"{new['country']}.")


_BUILDERS: dict[str, TaskBuilder] = {"cancel": _cancel, "return": _return, "exchange": _exchange,
                                     "modify_order_address": _modify_order_address,
                                     "modify_order_payment": _modify_order_payment,
                                     "modify_user_address": _modify_user_address}


def _replay_ok(db: dict[str, Any], actions: list[dict[str, Any]]) -> bool:
    """The gold actions run without error on a fresh copy and change the DB."""
    tools = RetailTools(RetailDB.model_validate(copy.deepcopy(db)))
    before = tools.db.get_hash()
    for action in actions:
        try:
            tools.function(action["name"])(**action["arguments"])
        except ValueError:
            return False
    return tools.db.get_hash() != before


def _tasks(rng: random.Random, db: dict[str, Any], count: int) -> list[dict[str, Any]]:
    orders = sorted(db["orders"])
    rng.shuffle(orders)
    used_orders: set[str] = set()
    tasks: list[dict[str, Any]] = []
    attempts = 0
    while len(tasks) < count:
        attempts += 1
        if attempts > 50 * count + 100:
            raise GenerationError(f"could only build {len(tasks)} of {count} tasks; add --users or ask for fewer tasks")
        kind = TASK_KINDS[len(tasks) % len(TASK_KINDS)] if attempts <= 10 * count else rng.choice(TASK_KINDS)
        free = [o for o in orders if o not in used_orders]
        if not free:
            raise GenerationError(f"only {len(tasks)} tasks fit in {len(orders)} orders; add --users")
        order = db["orders"][rng.choice(free)]
        built = _BUILDERS[kind](rng, db, order)
        if built is None:
            continue
        actions, reason = built
        user = db["users"][order["user_id"]]
        auth, known = _auth(rng, user)
        actions = [auth] + actions
        if not _replay_ok(db, actions):
            continue
        used_orders.add(order["order_id"])
        tid = str(len(tasks))
        tasks.append({
            "id": tid,
            "description": {"purpose": f"generated: {kind}", "relevant_policies": None, "notes": None},
            "user_scenario": {"persona": None, "instructions": {
                "domain": "retail", "reason_for_call": reason, "known_info": known,
                "unknown_info": "You do not know your user id.",
                "task_instructions": "Answer yes when the agent asks you to confirm the details."}},
            "initial_state": None,
            "evaluation_criteria": {
                "actions": [{"action_id": f"{tid}_{i}", "name": a["name"], "arguments": a["arguments"], "info": None}
                            for i, a in enumerate(actions)],
                "communicate_info": [], "nl_assertions": None, "reward_basis": ["DB"]},
        })
    return tasks


def generate_retail(users: int = 20, seed: int = 0, *, tasks: int | None = None, products: int = len(PRODUCTS),
                    test_fraction: float = 0.3) -> SyntheticRetail:
    """Build the domain (deterministic given the arguments). ``tasks`` defaults to ``users``."""
    if users < 1:
        raise GenerationError("users must be at least 1")
    if not 1 <= products <= len(PRODUCTS):
        raise GenerationError(f"products must be in 1..{len(PRODUCTS)}")
    if not 0.0 <= test_fraction < 1.0:
        raise GenerationError("test_fraction must be in [0, 1)")
    count = users if tasks is None else tasks
    if count < 1:
        raise GenerationError("tasks must be at least 1")
    rng = random.Random(seed)
    ids = _Ids(rng)
    product_map = _products(rng, ids, products)
    user_map = _users(rng, ids, users)
    db = {"products": product_map, "users": user_map, "orders": _orders(rng, ids, user_map, product_map)}
    RetailDB.model_validate(db)  # the schema the toolkit reads
    task_list = _tasks(rng, db, count)
    task_ids = [t["id"] for t in task_list]
    shuffled = list(task_ids)
    rng.shuffle(shuffled)
    n_test = round(len(task_ids) * test_fraction) if len(task_ids) > 1 else 0
    if test_fraction > 0 and len(task_ids) > 1:
        n_test = min(max(n_test, 1), len(task_ids) - 1)
    test = set(shuffled[:n_test])
    split = {"train": [t for t in task_ids if t not in test], "test": [t for t in task_ids if t in test]}
    return SyntheticRetail(db=db, policy=POLICY, tasks=task_list, split=split)


def write_retail(out_dir: str | Path, users: int = 20, seed: int = 0, *, overwrite: bool = False,
                 **kwargs: Any) -> Path:
    """Generate and write ``<out_dir>/tau2/domains/retail/``; returns the data root (``out_dir``)."""
    root = Path(out_dir)
    folder = root / "tau2" / "domains" / "retail"
    if (folder / "db.json").exists() and not overwrite:
        raise FileExistsError(f"{folder} already holds a domain; pass overwrite=True (--force) to replace it")
    domain = generate_retail(users, seed, **kwargs)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "db.json").write_text(json.dumps(domain.db, indent=1))
    (folder / "policy.md").write_text(domain.policy)
    (folder / "tasks.json").write_text(json.dumps(domain.tasks, indent=1))
    (folder / "split_tasks.json").write_text(json.dumps(domain.split, indent=1))
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m closedloop.evals.tau.synthetic",
                                     description="Write a small generated retail domain in the τ-bench data layout.")
    parser.add_argument("out_dir", help="data root to write (tau2/domains/retail/ is created inside)")
    parser.add_argument("--users", type=int, default=20, help="number of users (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--tasks", type=int, default=None, help="number of tasks (default: one per user)")
    parser.add_argument("--products", type=int, default=len(PRODUCTS),
                        help=f"number of product types, 1..{len(PRODUCTS)} (default all)")
    parser.add_argument("--test-fraction", type=float, default=0.3, help="share of tasks in the test split")
    parser.add_argument("--force", action="store_true", help="replace an existing domain in out_dir")
    args = parser.parse_args(argv)
    try:
        root = write_retail(args.out_dir, args.users, args.seed, overwrite=args.force, tasks=args.tasks,
                            products=args.products, test_fraction=args.test_fraction)
    except (GenerationError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    split = json.loads((root / "tau2/domains/retail/split_tasks.json").read_text())
    print(f"wrote {root / 'tau2/domains/retail'}: {args.users} users, "
          f"{len(split['train'])} train + {len(split['test'])} test tasks; "
          f"evaluate with: closedloop eval tau --agent oracle --data-dir {root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
