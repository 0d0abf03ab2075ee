"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
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


class ErrorJSONResponse(JSONResponse):
    """ASCII-escaped JSON: an error message that quotes undecodable client text (a lone
    surrogate) still renders, where UTF-8 encoding would fail and turn a 400 into a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return ErrorJSONResponse(error_body(status, message, param), status_code=status)


def _is_location(part: Any) -> bool:
    """pydantic puts union branches and validators in `loc` too ('list[int]', 'function-after[…]',
    'str'); a client wants only the path through its own JSON."""
    return isinstance(part, int) or (
        part != "body" and "[" not in part and part not in ("str", "int", "float", "bool")
    )


def describe_validation_errors(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for pydantic's errors: the most specific one (a failed check of ours
    beats "Input should be a valid string" from a union branch that never applied)."""
    if not errors:
        return "invalid request", None
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    location = [str(part) for part in first.get("loc", ()) if _is_location(part)]
    param = location[0] if location else None
    reason = str(first["msg"]).removeprefix("Value error, ")
    message = f"{'.'.join(location)}: {reason}" if location else reason
    return message, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return ErrorJSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI answers 400 for a malformed body.
        return error_response(400, *describe_validation_errors(list(error.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail))
