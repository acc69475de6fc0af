"""The airline domain (tau2 ``airline``): flights, reservations, cancellations, changes, baggage."""

from closedloop.evals.tau.domains.airline.db import FlightDB
from closedloop.evals.tau.domains.airline.tools import AirlineTools
from closedloop.evals.tau.domains.registry import Domain

AIRLINE = Domain(name="airline", db_model=FlightDB, toolkit=AirlineTools)

__all__ = ["AIRLINE", "AirlineTools", "FlightDB"]
