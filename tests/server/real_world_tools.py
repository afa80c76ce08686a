"""Tool parameter schemas in the shapes real agent stacks emit: pydantic's `model_json_schema`
(what LangChain, Pydantic AI and the OpenAI Agents SDK send: titles, `$defs` + `$ref`,
`anyOf` with null, `Literal` as enum/const, discriminated unions), MCP servers (draft-07 with
`$schema` and `definitions`), zod-to-json-schema, and OpenAI strict mode."""

from __future__ import annotations

import datetime
import enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field


class Priority(enum.Enum):
    LOW = "low"
    HIGH = "high"


class Address(BaseModel):
    street: str
    city: str
    country: str = "NL"


class Contact(BaseModel):
    name: str
    email: str | None = None
    addresses: list[Address] = []
    tags: dict[str, int] = {}


class Email(BaseModel):
    kind: Literal["email"]
    to: str


class Sms(BaseModel):
    kind: Literal["sms"]
    number: Annotated[str, Field(pattern=r"^\+[0-9]{6,15}$")]


class Notify(BaseModel):
    channel: Annotated[Email | Sms, Field(discriminator="kind")]
    priority: Priority = Priority.LOW
    at: datetime.datetime | None = None
    retries: Annotated[int, Field(ge=0, le=5)] = 0


class SearchArgs(BaseModel):
    query: Annotated[str, Field(min_length=1, max_length=200, description="what to look for")]
    limit: int = 10
    filters: list[tuple[str, str]] | None = None


class Tree(BaseModel):  # recursive: $ref to itself
    label: str
    children: list[Tree] = []


def pydantic_schemas() -> list[tuple[str, dict[str, Any]]]:
    return [(m.__name__.lower(), m.model_json_schema()) for m in (Contact, Notify, SearchArgs, Tree)]


MCP_READ_FILE = {
    "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
    "properties": {"path": {"type": "string"}, "head": {"type": "number", "description": "first N lines"},
                   "encoding": {"$ref": "#/definitions/encoding"}},
    "required": ["path"], "additionalProperties": False,
    "definitions": {"encoding": {"type": "string", "enum": ["utf-8", "latin-1"]}}}

ZOD_EDIT = {
    "type": "object", "properties": {
        "edits": {"type": "array", "items": {"type": "object", "properties": {
            "oldText": {"type": "string"}, "newText": {"type": "string"}},
            "required": ["oldText", "newText"], "additionalProperties": False}},
        "dryRun": {"type": "boolean", "default": False}},
    "required": ["edits"], "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}

OPENAI_STRICT = {
    "type": "object", "additionalProperties": False, "required": ["location", "unit", "when"],
    "properties": {"location": {"type": "string"}, "unit": {"type": ["string", "null"], "enum": ["c", "f", None]},
                   "when": {"anyOf": [{"type": "string", "format": "date"}, {"type": "null"}]}}}

BOOLEAN_SUBSCHEMAS = {"type": "object", "properties": {"anything": True, "free": {}}, "additionalProperties": False}

COMPUTER_USE = {
    "type": "object", "properties": {
        "action": {"type": "string", "enum": ["key", "type", "mouse_move", "left_click", "screenshot", "scroll"]},
        "coordinate": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
        "text": {"type": "string"}, "scroll_direction": {"enum": ["up", "down", "left", "right"]},
        "scroll_amount": {"type": "integer", "minimum": 0}},
    "required": ["action"]}

EMPTY = {"type": "object", "properties": {}}
NO_TYPE = {"properties": {"q": {"type": "string"}}, "required": ["q"]}
CONST_AND_ONEOF = {"type": "object", "properties": {
    "op": {"const": "set"}, "value": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
    "unique": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}, "required": ["op"]}


def real_world_tools() -> list[tuple[str, dict[str, Any]]]:
    return [*pydantic_schemas(), ("mcp_read_file", MCP_READ_FILE), ("zod_edit", ZOD_EDIT),
            ("openai_strict", OPENAI_STRICT), ("boolean_subschemas", BOOLEAN_SUBSCHEMAS),
            ("computer", COMPUTER_USE), ("empty", EMPTY), ("no_type", NO_TYPE), ("const_oneof", CONST_AND_ONEOF)]
