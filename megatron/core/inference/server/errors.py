"""OpenAI-style error bodies, ``{"error": {"message", "type", "param", "code"}}``, and their handlers."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from megatron.core.errors import MegatronError
from megatron.core.inference.sampling import InvalidSamplingParamsError
from megatron.core.inference.stop_words import InvalidStopSequencesError

logger = logging.getLogger(__name__)


class APIError(MegatronError):
    """An error answered to the HTTP client with ``status`` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# pydantic names the branch of a union in an error's location ("str", "list[ContentPart]", ...).
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_union_branch(part) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or not re.fullmatch(r"[a-z_][a-z0-9_]*", part))


def _is_type_mismatch(error: dict) -> bool:
    kind = str(error.get("type", ""))
    return kind.endswith("_type") or (kind == "literal_error" and not isinstance(error.get("input"), str))


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    # Of a union's failed branches, report the one whose type the input had (not a type mismatch;
    # a literal's error for an input that is no string is one too).
    first = next((e for e in errors if not _is_type_mismatch(e)), errors[0])
    location = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_union_branch(part)]
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    where = ".".join(location) or "body"
    return bad_request(f"{where}: {first.get('msg')}", param=where if location else None, code="invalid_value")


_STATUS_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app returns an OpenAI error body with the right status."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _schema_error(request: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(InvalidSamplingParamsError)
    @app.exception_handler(InvalidStopSequencesError)
    async def _sampling_error(request: Request, exc: ValueError):
        # Their messages start with the name of the field at fault.
        field = re.match(r"[a-z_]*", str(exc)).group() or None
        return bad_request(str(exc), param=field, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(
            exc.status_code, str(exc.detail), type=error_type, code=_STATUS_CODES.get(exc.status_code)
        ).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error serving %s", request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}", type="server_error").response()
