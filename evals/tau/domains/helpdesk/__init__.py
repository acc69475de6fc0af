"""The helpdesk domain: arithmetic and weather questions, small enough for the tiny model (offline).

Why it exists: τ-bench's real domains need a model with a long context and a real user simulator
(retail's system prompt alone is about 9,600 tokens of the tiny model's tokenizer, more than its
8,192-token window), so an offline run of ``closedloop eval tau`` with a graph agent could only end
``context_window_exceeded``. This domain is in tau2's layout and uses tau2's semantics unchanged
(tools from docstrings, gold actions, ``communicate_info``), with a one-paragraph policy and the
three tools the tiny model was warmed up on (``add``, ``multiply``, ``get_weather``). Its data
ships with the package (``data/tau2/domains/helpdesk``: 12 tasks, 8 train and 4 test), so no
``--data-dir`` is needed:

    closedloop eval tau --domain helpdesk --agent oracle                     # gold replay: reward 1
    closedloop eval tau --domain helpdesk --agent react --model hf:out/tiny --user-model scenario

Each task is graded on ACTION (the right tool with the right arguments) and COMMUNICATE (the
result said to the user), as tau2 grades them.
"""

from __future__ import annotations

from pathlib import Path

from closedloop.evals.tau.domains.base import TauDB, Toolkit, is_tool
from closedloop.evals.tau.domains.registry import Domain

__all__ = ["HELPDESK", "HelpdeskDB", "HelpdeskTools"]


class HelpdeskDB(TauDB):
    """The weather the desk reports, by city."""

    weather: dict[str, str]


class HelpdeskTools(Toolkit):
    """Calculator and weather lookups (nothing here changes the DB)."""

    db: HelpdeskDB

    @is_tool(kind="read")
    def add(self, a: float, b: float) -> float:
        """Add two numbers.

        Args:
            a: The first addend.
            b: The second addend.
        """
        return a + b

    @is_tool(kind="read")
    def multiply(self, a: float, b: float) -> float:
        """Multiply two numbers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        return a * b

    @is_tool(kind="read")
    def get_weather(self, city: str) -> str:
        """Get the current weather for a city.

        Args:
            city: The city.
        """
        if city not in self.db.weather:
            raise ValueError("City not found")
        return self.db.weather[city]


#: The helpdesk domain with its data shipped beside it (used when no --data-dir is given).
HELPDESK = Domain(name="helpdesk", db_model=HelpdeskDB, toolkit=HelpdeskTools,
                  bundled_data=Path(__file__).resolve().parent / "data")
