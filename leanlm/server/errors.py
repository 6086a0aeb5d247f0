"""The mapping from what accepting a request can raise to its HTTP status, in the one error shape (error_body.py)."""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from leanlm.engine import EngineStoppedError, QueueFullError, RequestFailedError
from leanlm.loading.chat_encoding import ControlTokenError
from leanlm.server.error_body import error_response
from leanlm.server.protocol import InvalidParameterError, LimitExceededError, UnsupportedParameterError
from leanlm.server.served_models import ModelNotFoundError
from leanlm.server.serving import ContextLengthError

logger = logging.getLogger(__name__)


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    first = exc.errors(include_url=False)[0]
    parts = [str(part) for part in first.get("loc", ())]
    loc = ".".join(parts)
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON ({first.get('msg')})", None
    if first.get("type") == "json_type":
        return "the body must be a JSON object", None
    # `param` names the request field (pydantic's loc goes on into list items and union branches).
    return f"{loc}: {first.get('msg')}" if loc else str(first.get("msg")), parts[0] if parts else None


def map_exception(exc: BaseException) -> JSONResponse:
    """Errors raised while accepting a request -> their HTTP answer."""
    if isinstance(exc, ValidationError):
        message, param = validation_message(exc)
        return error_response(400, message, "invalid_request_error", param)
    if isinstance(exc, ModelNotFoundError):
        return error_response(404, str(exc), "invalid_request_error", "model", "model_not_found")
    if isinstance(exc, ContextLengthError):
        return error_response(400, str(exc), "invalid_request_error", exc.param, "context_length_exceeded")
    if isinstance(exc, (UnsupportedParameterError, LimitExceededError, InvalidParameterError, ControlTokenError)):
        return error_response(400, str(exc), "invalid_request_error", exc.param)
    if isinstance(exc, QueueFullError):
        return error_response(
            429,
            str(exc),
            "rate_limit_error",
            None,
            "rate_limit_exceeded",
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    if isinstance(exc, EngineStoppedError):
        return error_response(503, str(exc), "server_error", None, "unavailable", headers={"Retry-After": "5"})
    if isinstance(exc, (ValueError, TypeError)):
        return error_response(400, str(exc), "invalid_request_error")
    if isinstance(exc, RequestFailedError):
        return error_response(500, str(exc), "server_error")
    logger.exception("unexpected error", exc_info=exc)
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
