"""The run store: every run, its messages, turns and tool calls, in one DuckDB file.

Default file: ``$CLOSEDLOOP_STORE`` or ``~/.closedloop/runs.duckdb`` (see :mod:`closedloop.config`).
"""

from closedloop.store.pricing import Price, cost_usd, price_for, register_price
from closedloop.store.records import TERMINAL_STATUSES, RunRecord, RunStatus, RunSummary, ToolCallRecord
from closedloop.redact import REDACTED, redact, redact_text
from closedloop.store.schema import MIGRATIONS, SCHEMA_VERSION, StoreVersionError
from closedloop.store.store import ActiveRun, RunNotFoundError, RunStateError, RunStore, StoreBusyError, StoreOpenError

__all__ = ["RunStore", "ActiveRun", "RunRecord", "RunSummary", "ToolCallRecord", "RunStatus", "TERMINAL_STATUSES",
           "RunNotFoundError", "RunStateError", "StoreBusyError", "StoreOpenError", "StoreVersionError", "SCHEMA_VERSION", "MIGRATIONS",
           "REDACTED", "redact", "redact_text", "Price", "register_price", "price_for", "cost_usd"]
