"""When infrastructure errors make an evaluation's numbers meaningless, the command fails.

An episode that ended because a model server could not be reached (or timed out) says nothing
about the agent; benchmarks list such episodes apart and leave them out of their metrics. An
evaluation where most episodes ended that way used to print a table of zeros and exit 0, so a
script or CI job running it took it for a result. Every ``closedloop eval`` benchmark takes
``--max-infra-errors FRACTION`` (:func:`add_infra_errors_argument`) and exits 1 when the fraction
of infrastructure errors among its episodes is above it (:func:`infra_errors_failure`).
"""

from __future__ import annotations

import argparse

__all__ = ["DEFAULT_MAX_INFRA_ERRORS", "EXIT_INFRA_ERRORS", "add_infra_errors_argument", "infra_errors_failure"]

DEFAULT_MAX_INFRA_ERRORS = 0.1
EXIT_INFRA_ERRORS = 1


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction between 0 and 1")
    return value


def add_infra_errors_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--max-infra-errors FRACTION``: the share of episodes that may end in infrastructure errors
    before the command exits 1."""
    parser.add_argument("--max-infra-errors", type=_fraction, default=DEFAULT_MAX_INFRA_ERRORS, metavar="FRACTION",
                        help="exit 1 when more than this fraction of the episodes ended in infrastructure errors "
                             "(a model server unreachable or failing); 1 never fails")


def infra_errors_failure(errors: int, total: int, max_fraction: float) -> str | None:
    """The error line when ``errors`` of ``total`` episodes is above ``max_fraction``, else None."""
    if total <= 0 or errors <= 0 or errors / total <= max_fraction:
        return None
    return (f"{errors} of {total} episodes ({100 * errors / total:.0f}%) ended in infrastructure errors, above "
            f"--max-infra-errors {max_fraction:g}: the metrics above describe the infrastructure, not the agent")
