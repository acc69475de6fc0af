"""Prices per million tokens, so a run's ``cost_usd`` can be filled in from token usage.

Prices change; the built-in table is a dated convenience, not an authority. Override it with
:func:`register_price`, a ``CLOSEDLOOP_PRICES`` JSON file (``{"model": [in, out]}``, USD per
million tokens), or a ``price_fn`` given to :class:`~closedloop.store.RunStore`. Unknown models
cost ``None``, never 0: a local model is not free, we just do not know its price.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from closedloop.config import get_settings

__all__ = ["Price", "PRICES", "register_price", "price_for", "cost_usd", "PriceFn"]


@dataclass(frozen=True)
class Price:
    prompt_per_mtok: float
    completion_per_mtok: float

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.prompt_per_mtok + completion_tokens * self.completion_per_mtok) / 1e6


# OpenAI list prices (USD / 1M tokens, standard tier) as published in 2025.
PRICES: dict[str, Price] = {
    "gpt-4o": Price(2.50, 10.00),
    "gpt-4o-mini": Price(0.15, 0.60),
    "gpt-4.1": Price(2.00, 8.00),
    "gpt-4.1-mini": Price(0.40, 1.60),
    "gpt-4.1-nano": Price(0.10, 0.40),
    "o4-mini": Price(1.10, 4.40),
}

PriceFn = Callable[[str, int, int], "float | None"]


def register_price(model: str, prompt_per_mtok: float, completion_per_mtok: float) -> None:
    if prompt_per_mtok < 0 or completion_per_mtok < 0:
        raise ValueError("prices must be non-negative")
    PRICES[model] = Price(prompt_per_mtok, completion_per_mtok)


def _file_prices() -> dict[str, Price]:
    path = get_settings().prices_path
    if path is None:
        return {}
    try:
        raw = json.loads(path.read_text())
        return {str(k): Price(float(v[0]), float(v[1])) for k, v in raw.items()}
    except (OSError, ValueError, TypeError, IndexError, KeyError, AttributeError) as e:
        raise ValueError(f"CLOSEDLOOP_PRICES={path}: expected a JSON object {{model: [in, out]}}: {e}") from None


def _model_name(model: str) -> str:
    """``openai:gpt-4o@https://...`` -> ``gpt-4o``; plain names (and anything that is not a valid
    spec) pass through. The spec grammar is :func:`closedloop.models.parse_spec`'s, not a copy."""
    from closedloop.models import parse_spec

    try:
        return parse_spec(model).model
    except ValueError:
        return model


def price_for(model: str) -> Price | None:
    """Exact name first, then the longest known prefix (``gpt-4o-mini-2024-07-18`` -> ``gpt-4o-mini``)."""
    if not model:
        return None
    table = {**PRICES, **_file_prices()}
    name = _model_name(model)
    if name in table:
        return table[name]
    candidates = [k for k in table if name.startswith(k + "-")]
    return table[max(candidates, key=len)] if candidates else None


def cost_usd(model: str, prompt_tokens: int, completion_tokens: int) -> float | None:
    price = price_for(model)
    return None if price is None else price.cost(prompt_tokens, completion_tokens)
