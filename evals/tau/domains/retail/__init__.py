"""The retail domain (tau2 ``retail``): orders, returns, exchanges, address and payment changes."""

from closedloop.evals.tau.domains.registry import Domain
from closedloop.evals.tau.domains.retail.db import RetailDB
from closedloop.evals.tau.domains.retail.tools import RetailTools

RETAIL = Domain(name="retail", db_model=RetailDB, toolkit=RetailTools)

__all__ = ["RETAIL", "RetailDB", "RetailTools"]
