"""Exact arithmetic tools: the smallest real tools, used by the demo, the docs and the tests.

The tiny local model is warmed up to call ``add`` and ``multiply``, so an offline run shows a
real tool round trip.
"""

from __future__ import annotations

from closedloop.tool import Tool, tool


@tool(isolation="inline")  # pure arithmetic: a thread hop would cost more than the call
def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


@tool(isolation="inline")  # pure arithmetic: a thread hop would cost more than the call
def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


TOOLS: list[Tool] = [add, multiply]
