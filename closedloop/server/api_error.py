"""The server's errors as the client sees them (OpenAI's ``{"error": {...}}`` body) and the mapping
of a backend's exception to one: the caller's fault is a 400, a dead backend a 503, ours a 500
with the traceback in the log, never on the wire."""

from __future__ import annotations

import logging
import traceback
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from closedloop.models.base import ContextLengthExceededError, ModelError, ModelUnavailableError
from closedloop.redact import redact_spec
from closedloop.server.schemas import ErrorBody, ErrorResponse

log = logging.getLogger("closedloop.server")


class APIError(Exception):
    """An error the client sees as OpenAI's ``{"error": {...}}`` body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        # A message may quote the caller's input; what cannot be encoded (lone surrogates) is escaped.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        param = param.encode("utf-8", "backslashreplace").decode("utf-8") if param else param
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status)


_UNION_LABELS = {"system", "user", "assistant", "tool", "str", "text", "image_url", "input_audio"}


def validation_error(e: ValidationError, prefix: str = "") -> APIError:
    """The first problem as OpenAI reports it: a dotted ``param`` path and a message naming it.

    Pydantic's location includes union-member labels (``user``, ``str``); they mean nothing to the
    caller and are left out of the path.
    """
    def path(err: ErrorDetails) -> str:
        parts = [str(p) for p in err.get("loc", ())
                 if not (isinstance(p, str) and (p in _UNION_LABELS or "[" in p))]
        if prefix and parts[:1] == [prefix]:
            parts = parts[1:]
        return ".".join([prefix] + parts if prefix else parts)

    errors = e.errors()
    param = path(errors[0]) or None
    # A union field fails once per member; show a few so "not a string" is not the only hint.
    details = "; ".join(dict.fromkeys(f"{path(err) or 'body'}: {err.get('msg', 'invalid value')}"
                                      for err in errors[:3]))
    return APIError(400, details, param=param, code="invalid_value")


def log_failure(what: str, e: BaseException) -> None:
    """The traceback to the server's log, credentials redacted (an upstream ``openai:`` spec's key
    is in the message of every error its client raises); paths stay, for the operator."""
    trace = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    log.error("%s\n%s", what, redact_spec(trace))


def model_failure(e: Exception, public: Any = str) -> APIError:
    """Map a backend exception: bad input the backend caught is the caller's (400), a dead
    backend is 503, anything else is ours (500). The traceback goes to the log, not the wire;
    the message goes through ``public`` (:meth:`_Server.public`: no model path, no credential)."""
    if isinstance(e, ModelUnavailableError):
        return APIError(503, public(f"model unavailable: {e}"), type="server_error", code="model_unavailable")
    if isinstance(e, ValueError):
        return APIError(400, public(str(e)), code="invalid_value")
    if isinstance(e, ContextLengthExceededError):
        # Like OpenAI: an over-long prompt is the caller's fault, with its own code.
        return APIError(400, public(str(e)), param="messages", code="context_length_exceeded")
    log_failure("model call failed", e)
    kind = "model error" if isinstance(e, ModelError) else "internal error"
    return APIError(500, public(f"{kind}: {type(e).__name__}: {e}"), type="server_error", code="model_error")
