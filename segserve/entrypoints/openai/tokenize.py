"""``/tokenize`` and ``/detokenize`` with vLLM 0.32's request and response shapes.

``POST /tokenize`` takes ``{"prompt": str, "add_special_tokens": true}`` or a chat
``{"messages": [...], "add_generation_prompt": true, "continue_final_message": false, "tools": [...],
"chat_template_kwargs": {...}}`` (tools rendered as the chat endpoint renders them) and answers
``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` only with
``return_token_strs``). ``POST /detokenize`` takes ``{"tokens": [...]}`` and answers ``{"prompt"}``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict

from segserve.entrypoints.openai import protocol as p
from segserve.entrypoints.openai.tool_calls import template_tools


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # strict.py's typing rules

    model: str | None = None
    prompt: str | None = None
    messages: list[p.ChatMessage] | None = None
    add_special_tokens: bool | None = None  # vLLM: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[p.ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # strict.py's typing rules

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


async def tokenize(serving, req: TokenizeRequest) -> TokenizeResponse:
    """Token ids of a prompt or a conversation. Raises ApiError(400) naming the bad field."""
    from segserve.entrypoints.openai.serving import bad_request

    serving.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    tok = serving.llm.tokenizer
    if req.prompt is not None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        serving.check_prompt_chars(len(req.prompt), "prompt")
        ids = await asyncio.to_thread(tok.encode, req.prompt, add_special_tokens=special)
    else:
        # The chat route's ids, under its rule (add_special_tokens: the tokenizer's specials on top).
        chat = p.ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message,
                                       chat_template_kwargs=req.chat_template_kwargs,
                                       add_special_tokens=bool(req.add_special_tokens))
        tools = template_tools(req.tools) if req.tools else None
        ids = await asyncio.to_thread(serving.chat_prompt_ids, chat, serving.chat_messages(chat), tools)
    strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=serving.max_model_len, tokens=ids, token_strs=strs)


async def detokenize(serving, req: DetokenizeRequest) -> DetokenizeResponse:
    """Text of token ids. Raises ApiError(400) for an id outside the vocabulary."""
    from segserve.entrypoints.openai.serving import bad_request

    serving.check_model(req.model)
    vocab = serving.llm.loaded.config.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"tokens entry {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
    return DetokenizeResponse(prompt=await asyncio.to_thread(serving.llm.tokenizer.decode, req.tokens))
