"""Response bodies as the routes build them, for the OpenAPI document (openapi.py).

The routes build plain dicts; these models only describe them, so that a client generator gets
types and the fuzz run (bench/fuzz.py) checks every 200 against them: a body that drifts from
its description fails `response_schema_conformance`. Extra fields are allowed (a later field is
not a break); the ones listed are required and typed.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class CachedTokens(_Out):
    cached_tokens: int


class AgentserveUsage(_Out):
    reused_tokens: int
    prefilled_tokens: int
    generated_tokens: int
    recomputed_tokens: int
    time_to_first_token_ms: float | None
    queue_ms: float | None
    session_id: str | None


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: CachedTokens
    agentserve: AgentserveUsage


class CalledFunction(_Out):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(_Out):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"]


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: None
    finish_reason: Literal["stop", "length", "abort"]
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None


class Completion(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Out):
    status: str


class SessionInfo(_Out):
    id: str
    trajectory_id: str
    created: float
    last_request: float
    closed: float | None
    num_requests: int
    prompt_tokens: int
    reused_tokens: int
    generated_tokens: int


BY_PATH: dict[str, type[_Out]] = {
    "/v1/chat/completions": ChatCompletion, "/v1/completions": Completion, "/v1/models": ModelList,
    "/health": Health, "/v1/sessions/{session_id}": SessionInfo, "/v1/sessions/{session_id}/close": SessionInfo,
}
