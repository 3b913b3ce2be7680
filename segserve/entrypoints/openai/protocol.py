"""Request and response bodies of the OpenAI-compatible API (pydantic), with vLLM's sampling extras.

Field names and defaults follow OpenAI's API reference (``/v1/completions``: ``max_tokens`` 16;
``/v1/chat/completions``: no token limit; ``temperature`` and ``top_p`` 1) plus vLLM's extensions
(``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``cache_salt`` and
``fields.LogitsFields``). Unknown and unimplemented fields are kept in ``model_extra`` and refused with
a 400 naming them (``fields.unhonoured_field``): a field that changes a request's meaning is never
silently dropped. Request models follow the strict typing and null rules of ``strict.py``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from segserve.entrypoints.openai.fields import LogitsFields
from segserve.entrypoints.openai.strict import StrictRequest, StrictSampling
from segserve.entrypoints.openai.structured import ResponseFormat, StructuredOutputsField
from segserve.entrypoints.openai.tool_calls import ChatTool, DeltaToolCall, ToolCall, ToolChoice


class _Lenient(StrictRequest):
    # Kept, then refused by name in serving (fields.unhonoured_field).
    model_config = ConfigDict(extra="allow")


class StreamOptions(StrictRequest):
    """vLLM 0.32's stream options: usage in a last chunk, or in every chunk (``continuous_usage_stats``)."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Lenient, StrictSampling, LogitsFields):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # accepted and harmless: tags for the caller's own bookkeeping
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default"] | None = None
    store: Literal[False] | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs (see .structured)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    cache_salt: str | None = None

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, v: str | None) -> str | None:
        if v is not None and not v:
            raise ValueError("cache_salt must be a non-empty string if provided")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (vLLM: only together with ``include_usage``)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: a prompt (text or token ids) or a list of them."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    # vLLM 0.32: a text prompt gets the tokenizer's special tokens (e.g. BOS); token ids are as given.
    add_special_tokens: bool = True
    request_id: str | None = None  # vLLM 0.32: the response's id is "cmpl-" and this (serving.response_id)


class ContentPart(_Lenient):
    """A content part; only ``{"type": "text", "text": ...}`` is implemented (serving refuses others)."""

    type: str = "text"
    text: str | None = None


class ChatMessage(_Lenient):
    role: str
    content: str | list[ContentPart] | None = None
    # An assistant turn's calls (OpenAI's shape, passed to the chat template) and a tool's reply.
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # vLLM joins text parts with newlines ("string" format)
            return "\n".join(part.text or "" for part in self.content)
        return self.content or ""

    def unsupported_part(self) -> str | None:
        """What is wrong with the first content part that is not plain text, or None."""
        for part in self.content if isinstance(self.content, list) else ():
            if part.type != "text":
                return f"content part type {part.type!r} is not supported (only 'text')"
            if part.text is None:
                return "a 'text' content part needs a 'text' field"
            if part.model_extra:
                return f"content part field {sorted(part.model_extra)[0]!r} is not supported"
        return None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last message open (it must then be the model's)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM 0.32: the rendered template gets the tokenizer's special tokens (e.g. BOS) on top when true.
    add_special_tokens: bool = False
    request_id: str | None = None  # vLLM 0.32: the response id is "chatcmpl-" and this (response_id)


# ---- responses -------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage_info(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    """``usage`` of a response (token counts)."""
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def _now() -> int:
    return int(time.time())


class CompletionLogProbs(BaseModel):
    """OpenAI's legacy completions logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    """Chat logprobs: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    content: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """A streamed chunk's change to the message: only the fields it sets are sent (``{"content": "!"}``,
    the role with a choice's first chunk, ``{}`` for a chunk that only finishes), as vLLM (which dumps
    chunks with ``exclude_unset``) and OpenAI send them."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token id that ended the choice


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "segserve"
    root: str
    parent: str | None = None
    max_model_len: int
    permission: list[dict[str, Any]] = Field(default_factory=list)


def model_permission() -> dict[str, Any]:
    """vLLM's ``ModelPermission`` entry of a model card."""
    import uuid

    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": _now(),
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False}


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo
