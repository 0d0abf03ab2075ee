"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    503: "service_unavailable",
}

# SamplingParams and our own checks start messages with the offending parameter's name.
_LEADING_PARAM = re.compile(r"^([a-z_]+) ")


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> APIError:
        if param is None and (match := _LEADING_PARAM.match(message)):
            param = match.group(1)
        return cls(400, message, param=param)

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(
                status, "server_error" if status >= 500 else "invalid_request_error"
            ),
            "param": param,
            "code": code if code is not None else status,
        }
    }


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI answers 400 for a malformed body.
        first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request"}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = location[0] if location else None
        message = f"{'.'.join(location)}: {first['msg']}" if location else str(first["msg"])
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail))
