"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a 4xx status.

A request pydantic rejects gets a 400 whose `param` is the field's path in the body as the client
wrote it (`messages[0].content[1].text`) and whose message says what the field must be and what
came instead. Anything a route did not expect is a 500 of the same shape, never a traceback.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentserve.server.openapi import document

log = logging.getLogger(__name__)


def _printable(text: str) -> str:
    """`text` as it can go into a UTF-8 response: a lone surrogate becomes its escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.code = status, type_, code
        self.message = _printable(message)
        self.param = None if param is None else _printable(param)
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers={**self.headers, **(headers or {})})


_KINDS = {"string_type": "a string", "int_type": "an integer", "float_type": "a number",
          "bool_type": "a boolean", "none_required": "null", "list_type": "an array",
          "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object"}


def _got(value: Any) -> str:
    """A received value, short, as JSON would spell it."""
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, (bytes, bytearray)):
        return "a body that is not JSON"
    text = json.dumps(value, default=repr)  # ASCII: escapes any surrogate
    return text if len(text) <= 60 else text[:57] + "..."


def _param(loc: Sequence[Any], body: Any, missing: bool) -> str:
    """The field's path in the body. A location part that is no key or index of the body at that
    point is a union member or tag (protocol.py), which the client never wrote: skipped."""
    out, node = "", body
    for i, part in enumerate(loc):
        if isinstance(part, int) and isinstance(node, list) and 0 <= part < len(node):
            out, node = f"{out}[{part}]", node[part]
        elif isinstance(part, str) and isinstance(node, dict) and part in node:
            out, node = f"{out}.{part}" if out else part, node[part]
        elif missing and i == len(loc) - 1 and isinstance(part, str):
            out = f"{out}.{part}" if out else part
    return out


def _length(err: dict[str, Any], param: str) -> str:
    value, ctx = err.get("input"), err.get("ctx", {})
    size = len(value) if isinstance(value, (str, list, dict)) else None

    def count(n: Any) -> str:
        return f"{n} {'character' if isinstance(value, str) else 'item'}{'' if n == 1 else 's'}"

    if "min_length" in ctx:
        if ctx["min_length"] == 1:
            return f"{param} is empty"
        return f"{param} must have at least {count(ctx['min_length'])}, got {size}"
    return f"{param} is too long: at most {count(ctx.get('max_length'))}, got {size}"


_BOUNDS = {"greater_than_equal": ("ge", "at least"), "greater_than": ("gt", "greater than"),
           "less_than_equal": ("le", "at most"), "less_than": ("lt", "less than")}


def _describe(err: dict[str, Any], param: str, kinds: list[str]) -> str:
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx", {})
    if kind == "missing":
        return f"{param} is required"
    if kinds:
        return f"{param} must be {' or '.join(kinds)}, got {_got(value)}"
    if kind in ("json_kind", "part_type"):
        got = f"type {_got(value.get('type'))}" if kind == "part_type" and isinstance(value, dict) else _got(value)
        return f"{param} must be {err['msg']}, got {got}"
    if kind in ("too_short", "string_too_short", "too_long", "string_too_long"):
        return _length(err, param)
    if kind in _BOUNDS:
        key, words = _BOUNDS[kind]
        return f"{param} must be {words} {ctx.get(key)}, got {_got(value)}"
    if kind == "finite_number":
        return f"{param} must be a finite number, got {_got(value)}"
    if kind == "literal_error":
        return f"{param} must be {ctx.get('expected')}, got {_got(value)}"
    if kind == "string_unicode":
        return f"{param} must be valid Unicode: it contains a lone UTF-16 surrogate escape"
    if kind == "string_pattern_mismatch":
        return f"{param} must match {ctx.get('pattern')}, got {_got(value)}"
    return f"{param}: {err.get('msg', 'invalid value').removeprefix('Value error, ')}"


def _body_error(err: dict[str, Any]) -> APIError:
    value = err.get("input")
    if err["type"] == "missing":
        return APIError(400, "the request body is required: a JSON object", code="invalid_value")
    if isinstance(value, (bytes, bytearray, str)):
        return APIError(400, "the request body must be a JSON object, sent with Content-Type: "
                             "application/json", code="invalid_json")
    if err["type"] == "value_error" and isinstance(value, dict):  # a rule across fields
        return APIError(400, str(err.get("msg", "invalid value")).removeprefix("Value error, "),
                        code="invalid_value")
    return APIError(400, f"the request body must be a JSON object, got {_got(value)}", code="invalid_value")


def _split(loc: Sequence[Any]) -> tuple[str, tuple[Any, ...]]:
    """FastAPI's location: where (body, path, query, header), then the path inside it."""
    loc = tuple(loc)
    if loc and loc[0] in ("body", "path", "query", "header"):
        return loc[0], loc[1:]
    return "body", loc


def validation_error(errors: Sequence[Any], body: Any) -> APIError:
    """The first of pydantic's errors as an OpenAI error naming the field."""
    first = dict(errors[0]) if errors else {"type": "invalid", "loc": ("body",), "msg": "invalid request"}
    source, loc = _split(first.get("loc", ()))
    if first["type"] == "json_invalid":
        ctx = first.get("ctx", {})
        return APIError(400, f"malformed JSON body: {ctx.get('error', 'cannot parse')} "
                             f"(at character {loc[-1] if loc else '?'})", code="invalid_json")
    if source == "body" and not loc:
        return _body_error(first)

    def param_of(err: dict[str, Any]) -> str:
        where, path = _split(err.get("loc", ()))
        if where != "body":
            return ".".join(str(p) for p in path)
        return _param(path, body, err["type"] == "missing")

    param = param_of(first)
    kinds: list[str] = []
    if first["type"] in _KINDS:  # each member of a union fails with its own type error: list them
        for err in errors:
            kind = _KINDS.get(err["type"])
            if kind is not None and kind not in kinds and param_of(err) == param:
                kinds.append(kind)
    return APIError(400, _describe(first, param or "body", kinds), param=param or None, code="invalid_value")


def _parse_failure(exc: StarletteHTTPException) -> str:
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not UTF-8: {cause.reason} at byte {cause.start}"
    if isinstance(cause, RecursionError):
        return "malformed JSON body: nested too deeply"
    if cause is not None:
        return f"malformed JSON body: {cause}"
    return str(exc.detail)


def install_handlers(app: FastAPI) -> None:
    document(app)  # the document states these handlers' responses

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors(), exc.body).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not read the body
            return APIError(400, _parse_failure(exc), code="invalid_json").response()
        return APIError(exc.status_code, str(exc.detail), code=code).response(exc.headers)  # 405: Allow

    @app.exception_handler(json.JSONDecodeError)
    async def _json(_: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return APIError(400, f"malformed JSON body: {exc.msg} at line {exc.lineno} column {exc.colno}",
                        code="invalid_json").response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback and re-raises after this; the client gets the same shape.
        log.error("unexpected error on %s %s: %r", request.method, request.url.path, exc)
        return APIError(500, f"internal server error ({type(exc).__name__}); see the server log",
                        type_="server_error").response()
