"""Every error the server answers has the OpenAI shape
`{"error": {"message", "type", "param", "code"}}`, FastAPI's own (404 unknown route, 405 wrong
method, a body that is not JSON) included: one handler per kind of exception, installed by
`install_error_handlers`; `answers_500` turns a route's unexpected exception into a 500."""

from __future__ import annotations

import functools
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from eaglekv.errors import EaglekvError, KVIndexError, RequestFailed
from eaglekv.server.protocol import RequestRefused

log = logging.getLogger("eaglekv.server")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 422: "invalid_request_error",
               499: "aborted", 500: "internal_error"}


class ModelNotFound(LookupError):
    pass


def error_json(status: int, message: str, type_: str | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_ or ERROR_TYPES.get(status, "error"),
                      "param": param, "code": status}}


def error_body(status: int, message: str, type_: str | None = None, param: str | None = None,
               headers: dict | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_json(status, message, type_, param),
                        headers=headers)


def failure_status(exc: BaseException) -> int:
    """The HTTP status of an error raised for one request: the client's fault (400) or ours."""
    if isinstance(exc, RequestRefused):
        return 400
    if isinstance(exc, (KVIndexError, RequestFailed)) or not isinstance(exc, EaglekvError):
        return 500
    return 400


def failure_json(exc: BaseException) -> tuple[int, dict]:
    status = failure_status(exc)
    message = str(exc) if isinstance(exc, RequestRefused) else f"{type(exc).__name__}: {exc}"
    return status, error_json(status, message, param=getattr(exc, "param", None))


def _validation_message(err: dict) -> tuple[str, str | None]:
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    where = ".".join(loc) or "body"
    if err.get("type") == "extra_forbidden":
        return f"unknown field '{where}'", loc[0] if loc else None
    if err.get("type") == "json_invalid":
        ctx = err.get("ctx") or {}
        return f"the body is not valid JSON: {ctx.get('error', err.get('msg'))}", None
    return f"{where}: {err.get('msg')}", loc[0] if loc else None


def answers_500(route):
    """Any unexpected exception of a route becomes an OpenAI-style 500 here. (Starlette's
    catch-all handler re-raises after answering, and the connection may be reset before the
    client reads the body.) The known errors go on to their own handlers."""
    @functools.wraps(route)
    async def wrapper(*args, **kwargs):
        try:
            return await route(*args, **kwargs)
        except (EaglekvError, RequestRefused, ModelNotFound):
            raise
        except Exception as e:  # noqa: BLE001
            log.exception("request failed")
            return error_body(500, f"{type(e).__name__}: {e}")
    return wrapper


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        msg, param = _validation_message(exc.errors()[0])
        return error_body(400, msg, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        msg = str(exc.detail)
        if exc.status_code in (404, 405):
            msg = f"{msg}: {request.method} {request.url.path}"
        elif exc.status_code == 400 and "parsing the body" in msg:
            msg = "the body could not be parsed as JSON (invalid UTF-8, or nested too deeply)"
        return error_body(exc.status_code, msg, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestRefused)
    async def _refused(_, exc: RequestRefused):
        return error_body(400, str(exc), param=exc.param)

    @app.exception_handler(EaglekvError)
    async def _engine_refused(_, exc: EaglekvError):
        status, body = failure_json(exc)
        return JSONResponse(status_code=status, content=body)

    @app.exception_handler(ModelNotFound)
    async def _no_model(_, exc: ModelNotFound):
        return error_body(404, str(exc), param="model")

    @app.exception_handler(Exception)
    async def _crash(_, exc: Exception):   # a bug, not the client's fault: still a JSON body
        return error_body(500, f"{type(exc).__name__}: {exc}")
