"""OpenAI request bodies (pydantic), with the extras agent harnesses send to vLLM.

Validated at the door, so the engine, the chat template and the tokenizer only ever see what
these models describe:
- strict types: `"5"` or `true` is not an integer, `"1"` is not a number, `1` is not a boolean;
  as in JSON Schema, an integer is a number and `2.0` is an integer (`2.5` is not);
- every union is discriminated, by JSON type (`_kind`) or by a content part's `type`, so an error
  names the one member the value was meant to be, not every member it failed;
- every string is valid Unicode (a lone surrogate from a `\\ud800` escape cannot reach the
  tokenizer, nor be echoed into a response that then fails to encode);
- bounded where an unbounded value would reach the engine (stop strings, token ids, ids, free-form
  JSON depth); ranges are in the schema, so the OpenAPI document states them too.
Unknown fields are ignored (`extra="ignore"`): harnesses send vLLM's extras and OpenAI's newer ones.
Union tags are written `<like-this>`: a tag shows up in an error's location, and errors.py drops
location parts that are not keys of the body, which a bracketed tag never is in practice.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, StrictBool,
                      Tag, WithJsonSchema, field_validator, model_validator)
from pydantic.json_schema import SkipJsonSchema

MAX_ID_CHARS = 256  # session, trajectory, model names, cache salts
MAX_CALL_ID_CHARS = 512  # tool call ids come from other servers and frameworks
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512  # a stream holds back this much text while a stop string may be starting
MAX_PROMPT_TOKEN_IDS = 1 << 20  # far above any context: the context check gives the real bound
MAX_TOKEN_ID = (1 << 31) - 1  # the vocabulary check gives the real bound
MAX_JSON_DEPTH = 32  # tool schemas and call arguments: rendered, dumped and compiled recursively
INT64 = 1 << 63
MEDIA_PARTS = ("image_url", "input_audio", "audio_url", "video_url", "file", "image")


def _unicode(s: str) -> str:
    if any("\ud800" <= c <= "\udfff" for c in s):
        raise ValueError("contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape)")
    return s


def check_json(value: Any, depth: int = 0) -> Any:
    """Free-form JSON: valid Unicode in keys and strings, at most MAX_JSON_DEPTH deep."""
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep")
    if isinstance(value, str):
        _unicode(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _unicode(k)
            check_json(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            check_json(v, depth + 1)
    return value


def _integral(value: Any) -> Any:
    """2.0 as 2: JSON does not tell them apart. Anything else goes on to the strict int check."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# Integers: the range inside the Annotated and before the validator, or the schema misses it.
_I = BeforeValidator(_integral)
Int = Annotated[int, _I]
Count = Annotated[int, Field(ge=1), _I]
TopK = Annotated[int, Field(ge=-1, description="0 or -1: no top-k cut"), _I]
Seed = Annotated[int, Field(ge=-INT64, le=INT64 - 1), _I]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID), _I]
JSONObject = Annotated[dict[str, Any], AfterValidator(check_json)]
# Strings: length constraints first (pydantic's own string errors), then the Unicode check.
_U = AfterValidator(_unicode)
Str = Annotated[str, _U]
NonEmptyStr = Annotated[str, Field(min_length=1), _U]
Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS), _U]
Name = Annotated[str, Field(max_length=MAX_ID_CHARS), _U]
CallId = Annotated[str, Field(max_length=MAX_CALL_ID_CHARS), _U]
StopStr = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS), _U]


def _kind(value: Any) -> str | None:
    """The JSON type of a parsed value, as a union tag."""
    for t, tag in ((bool, "<boolean>"), (int, "<integer>"), (float, "<number>"), (str, "<string>"),
                   (list, "<array>"), (dict, "<object>")):
        if isinstance(value, t):
            return tag
    return "<null>" if value is None else None


def _by_kind(expected: str) -> Discriminator:
    return Discriminator(_kind, custom_error_type="json_kind", custom_error_message=expected)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Body):
    type: Literal["text"]
    text: Str


class RefusalPart(_Body):
    """An assistant's refusal, as OpenAI clients replay it; not rendered (as OpenAI does)."""

    type: Literal["refusal"]
    refusal: Str


def _part_tag(value: Any) -> str | None:
    t = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if t in MEDIA_PARTS:
        return "<media>"
    return f"<{t}>" if t in ("text", "refusal") else None


def _no_media(part: Any) -> Any:
    raise ValueError(f"{part.get('type')} content parts are not supported: this server serves a "
                     "text-only model; send the content as text parts or a string")


ContentPart = Annotated[
    Annotated[TextPart, Tag("<text>")] | Annotated[RefusalPart, Tag("<refusal>")]
    | SkipJsonSchema[Annotated[Annotated[dict[str, Any], AfterValidator(_no_media)], Tag("<media>")]],
    Discriminator(_part_tag, custom_error_type="part_type",
                  custom_error_message="a content part of type 'text' (or 'refusal')")]
Content = Annotated[
    Annotated[Str, Tag("<string>")] | Annotated[list[ContentPart], Tag("<array>")]
    | Annotated[None, Tag("<null>")],
    _by_kind("a string, an array of content parts or null")]


class FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: Str | None = None
    parameters: JSONObject = Field(default_factory=lambda: {"type": "object", "properties": {}})


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionCall(_Body):
    name: CallId
    arguments: Annotated[
        Annotated[Str, Tag("<string>")] | Annotated[JSONObject, Tag("<object>")],
        _by_kind("a string of JSON or an object")] = "{}"


class ToolCallIn(_Body):
    id: CallId
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    name: Name | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: CallId | None = None
    reasoning_content: Str | None = None

    def text(self) -> str:
        """Content as text; text parts are joined, refusals are not rendered."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


def _named(function: dict[str, str]) -> dict[str, str]:
    if "name" not in function:
        raise ValueError("must name the function to call: {\"name\": ...}")
    return function


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: Annotated[dict[str, Str], AfterValidator(_named), WithJsonSchema(
        {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}},
         "additionalProperties": {"type": "string"}})]


class StreamOptions(_Body):
    include_usage: bool = False


Stop = Annotated[
    Annotated[StopStr, Tag("<string>")]
    | Annotated[list[StopStr], Field(max_length=MAX_STOP_STRINGS), Tag("<array>")]
    | Annotated[None, Tag("<null>")],
    _by_kind("a string, an array of strings or null")]


MAX_HINT_MS = 7 * 86_400_000  # a week: longer durations are absurd for a tool


class AgentHints(_Body):
    """What a harness may tell about the pause that follows this request's response."""

    tool_class: Id | None = None
    expected_duration_ms: float | None = Field(default=None, ge=0, le=MAX_HINT_MS, allow_inf_nan=False)
    parent_trajectory_id: Id | None = None
    last_turn: bool = False  # the trajectory ends with this response (trajectory_finished)


TRAJECTORY_EVENTS = ("model_started", "tool_started", "tool_finished", "trajectory_finished",
                     "trajectory_cancelled")


class TrajectoryEventRequest(_Body):
    """POST /v1/trajectories/{id}/events. No prompt text, arguments or secrets."""

    event: Literal["model_started", "tool_started", "tool_finished", "trajectory_finished",
                   "trajectory_cancelled"]
    tool_class: Id | None = None
    emitted_at_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False,
                                        description="client wall clock, ms since the Unix epoch")
    expected_duration_ms: float | None = Field(default=None, ge=0, le=MAX_HINT_MS, allow_inf_nan=False)
    cache_salt: Id | None = None  # the tenant: the salt its requests carry
    success: StrictBool | None = Field(default=None, description="with trajectory_finished: the harness's "
                                       "verdict on the task (the ledger's cost per successful task)")

    @model_validator(mode="after")
    def _success_ends(self) -> TrajectoryEventRequest:
        if self.success is not None and self.event != "trajectory_finished":
            raise ValueError(f"success is only meaningful with trajectory_finished, not {self.event}")
        return self


class _Sampling(_Body):
    model: Id
    max_tokens: Count | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: TopK | None = None
    stop: Stop = None
    seed: Seed | None = None
    n: Int = Field(default=1, json_schema_extra={"minimum": 1, "maximum": 1})
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | Int | None = Field(default=None, json_schema_extra={"enum": [False, 0, None]})
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0), _I] = 0
    return_token_ids: bool = False
    session_id: Id | None = None
    trajectory_id: Id | None = None
    cache_salt: Id | None = None
    prompt_cache_key: Id | None = None  # OpenAI's; harnesses set it per conversation
    user: Id | None = None
    agent_hints: AgentHints | None = None
    cache_receipt: StrictBool = Field(default=False, description="put a cache receipt of the reused prefix "
                                      "in usage.agentserve.cache_receipt (docs/ledger.md)")

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        return None if v is None or v in (0, -1) else v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"n={v} is not supported; send n=1 (or several requests)")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | int | None) -> bool | int | None:
        if v:
            raise ValueError("logprobs are not supported by this server; omit the field")
        return v

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Annotated[
        Annotated[Literal["none", "auto", "required"], Tag("<string>")]
        | Annotated[NamedToolChoice, Tag("<object>")] | Annotated[None, Tag("<null>")],
        _by_kind("\"none\", \"auto\", \"required\", {\"type\": \"function\", \"function\": "
                 "{\"name\": ...}} or null")] = None
    max_completion_tokens: Count | None = None
    parallel_tool_calls: bool = True
    repeated_tool_calls: Literal["drop", "keep"] = "drop"  # calls already answered: server/tool_loop.py


def _prompt_tag(value: Any) -> str | None:
    """Text, token ids, or a one-element list of either (what OpenAI clients send for one prompt)."""
    if isinstance(value, str):
        return "<text>"
    if not isinstance(value, list):
        return None
    first = value[0] if value else None
    return "<texts>" if isinstance(first, str) else "<id-lists>" if isinstance(first, list) else "<ids>"


TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)]


class CompletionRequest(_Sampling):
    prompt: Annotated[
        Annotated[NonEmptyStr, Tag("<text>")] | Annotated[TokenIds, Tag("<ids>")]
        | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=1), Tag("<texts>")]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=1), Tag("<id-lists>")],
        Discriminator(_prompt_tag, custom_error_type="json_kind",
                      custom_error_message="a string, an array of token ids, or a one-element array "
                                           "of either")]
    echo: bool = Field(default=False, json_schema_extra={"enum": [False]})

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[Any]) -> str | list[int]:
        return v[0] if isinstance(v, list) and isinstance(v[0], (str, list)) else v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported by this server; omit the field")
        return v
