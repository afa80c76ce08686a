"""The OpenAPI document: FastAPI's, plus what it cannot see in the route signatures.

FastAPI documents a 422 with its own validation body; this server answers 400 with errors.py's
body, and a generation route can also answer 404/409/413/429/500/503 in that shape. The routes
return plain dicts, described by responses.py. A request with `stream: true` gets server-sent
events, and /metrics is Prometheus text. Documenting these
lets a client generator, and the schemathesis fuzz run (bench/fuzz.py), check every response
against the schema: status, media type and body.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic.json_schema import models_json_schema

from agentserve.server.responses import BY_PATH

ERROR = {
    "type": "object", "required": ["error"], "title": "Error",
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string", "description": "invalid_request_error or server_error"},
            "param": {"anyOf": [{"type": "string"}, {"type": "null"}],
                      "description": "the field at fault, as a path in the body: messages[0].content"},
            "code": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        }}},
}
_WHY = {
    "400": "invalid request: `param` names the field, `message` says what it must be",
    "404": "unknown model, session or trajectory (or trajectory tracking is off: --residency off; the ledger "
           "is off: --no-ledger)",
    "409": "the session named by session_id is closed",
    "413": "request body too large",
    "429": "over the admission bounds: retry after the Retry-After header's seconds",
    "500": "the engine failed this request (the others in flight are unaffected)",
    "503": "the engine is not running",
}
_GENERATION = ("400", "404", "409", "413", "429", "500", "503")
_BY_PATH = {"/health": ("503",), "/v1/sessions/{session_id}": ("404",),
            "/v1/sessions/{session_id}/close": ("404",), "/v1/trajectories/stats": ("404", "503"),
            "/v1/trajectories/{trajectory_id}": ("400", "404", "503"),
            "/v1/trajectories/{trajectory_id}/ledger": ("400", "404", "503")}
_PLAIN_TEXT = {"/metrics": "text/plain; version=0.0.4"}
EVENT_STREAM = {"schema": {  # one event: its data is a chunk as JSON, the last one's is [DONE]
    "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}}


def _error(code: str) -> dict[str, Any]:
    return {"description": _WHY[code],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _streams(op: dict[str, Any], schemas: dict[str, Any]) -> bool:
    ref = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {}).get("$ref", "")
    return "stream" in schemas.get(ref.rsplit("/", 1)[-1], {}).get("properties", {})


def _amend(path: str, op: dict[str, Any], schemas: dict[str, Any]) -> None:
    responses = op.setdefault("responses", {})
    responses.pop("422", None)
    codes = _GENERATION if "requestBody" in op else _BY_PATH.get(path, ())
    for code in codes:
        responses.setdefault(code, _error(code))
    ok = responses.get("200", {}).setdefault("content", {})
    if path in BY_PATH:
        ok["application/json"] = {"schema": {"$ref": f"#/components/schemas/{BY_PATH[path].__name__}"}}
    if path in _PLAIN_TEXT:
        ok.clear()
        ok[_PLAIN_TEXT[path]] = {"schema": {"type": "string"}}
    elif _streams(op, schemas):
        ok.setdefault("text/event-stream", EVENT_STREAM)


def document(app: FastAPI) -> None:
    """Make `app.openapi()` return the amended document (built once, on first use: the routes
    are registered after this is called)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None and "Error" in app.openapi_schema["components"]["schemas"]:
            return app.openapi_schema
        schema = generate()
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, methods in schema.get("paths", {}).items():
            for op in methods.values():
                _amend(path, op, schemas)
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        schemas["Error"] = ERROR
        _, described = models_json_schema([(m, "serialization") for m in set(BY_PATH.values())],
                                          ref_template="#/components/schemas/{model}")
        for name, body in described.get("$defs", {}).items():
            schemas.setdefault(name, body)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
