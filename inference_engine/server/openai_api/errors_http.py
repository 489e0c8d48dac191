"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP status
from the one error table (status_codes.py); nothing ever shows a traceback."""

from __future__ import annotations

import logging
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from inference_engine.errors import InvalidRequest, RuntimeServiceError
from inference_engine.status_codes import spec_of

log = logging.getLogger(__name__)

# OpenAI's `type` for a status (its SDKs pick the exception class from the status alone).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable_error"}


def error_body(message: str, status: int, code: str, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_of(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """Status, body and headers of an error (anything unexpected: 500, logged once with its traceback)."""
    spec = spec_of(exc)
    if not isinstance(exc, RuntimeServiceError):
        log.error("unexpected error in an HTTP API request", exc_info=exc)
        message = f"internal error: {type(exc).__name__}"
    else:
        message = str(exc)
    param = exc.field or None if isinstance(exc, InvalidRequest) else None
    headers = {}
    if spec.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(spec.retry_after_s)))
    if spec.http == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return spec.http, error_body(message, spec.http, spec.reason.lower(), param), headers


def error_response(exc: BaseException) -> JSONResponse:
    """The JSON response of an error."""
    status, body, headers = error_of(exc)
    return JSONResponse(body, status_code=status, headers=headers)


def validation_response(exc: RequestValidationError, content_type: str = "application/json") -> JSONResponse:
    """A body that is not JSON or does not fit the schema: 400 naming the first wrong field (no input echoed).

    Args:
        content_type: the request's Content-Type (a body sent as another type is not read as JSON).
    """
    if "json" not in content_type.lower():  # FastAPI reads a body as JSON only when its type says so
        message = (f"the request body is sent as {content_type[:80] or 'no content type'!r}; send it as JSON with "
                   "the header Content-Type: application/json")
        return JSONResponse(error_body(message, 400, "invalid_request"), status_code=400)
    problems = []
    param = None
    for e in exc.errors()[:5]:
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        if param is None and loc:
            param = ".".join(loc)
        problems.append(f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid')}")
    message = "the request body is not valid: " + "; ".join(problems or ["not a JSON object"])
    return JSONResponse(error_body(message, 400, "invalid_request", param), status_code=400)
