"""Redaction lives in :mod:`closedloop.redact` (a leaf module any layer may import); this name stays
for older imports."""

from closedloop.redact import (REDACTED, _env_secrets, env_secrets, is_sensitive_key, might_hold_secret, redact,
                               redact_arguments, redact_message, redact_message_json, redact_spec, redact_text,
                               redacted_message_json)

__all__ = ["REDACTED", "is_sensitive_key", "env_secrets", "redact", "redact_text", "redact_arguments",
           "redact_message", "might_hold_secret", "redact_message_json", "redacted_message_json", "redact_spec",
           "_env_secrets"]
