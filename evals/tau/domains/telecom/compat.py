"""The few tau2 helpers the ported telecom code uses (tau2's ``pydantic_utils`` and ``telecom.utils``)."""

from __future__ import annotations

from datetime import date, datetime
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

T = TypeVar("T", bound=BaseModel)


class BaseModelNoExtra(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """addict's ``Dict.update``: nested dicts merge, everything else is replaced."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def update_pydantic_model_with_dict(model_instance: T, update_data: dict[str, Any]) -> T:
    """A new instance with ``update_data`` merged into the dumped model (tau2's helper)."""
    return type(model_instance).model_validate(_merge(model_instance.model_dump(), dict(update_data)))


def get_now() -> datetime:
    return datetime(2025, 2, 25, 12, 8, 0)  # tau2: "assume now is 2025-02-25 12:08:00"


def get_today() -> date:
    return date(2025, 2, 25)
