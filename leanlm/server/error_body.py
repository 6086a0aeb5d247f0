"""The one shape of every error a leanlm HTTP process answers, OpenAI's
{"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi.responses import JSONResponse


def error_response(
    status: int,
    message: str,
    err_type: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)
