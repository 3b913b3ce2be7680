"""Route logic of the OpenAI-compatible server: validate, build sampling parameters, add the request to
the ``AsyncLLMEngine``, and turn its outputs into JSON or server-sent events.

Streaming follows OpenAI's wire format: ``data: {chunk}\\n\\n`` per event, deltas of the text, a
final chunk with ``finish_reason``, an optional usage chunk (``stream_options.include_usage``) with
empty ``choices``, then ``data: [DONE]``. A client that disconnects (streaming or not) aborts its
request, so its KV blocks return to the pool before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from segserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, OutputStream, QueueFullError
from segserve.entrypoints.openai import protocol as p
from segserve.entrypoints.openai.structured import FieldError, structured_outputs_of
from segserve.entrypoints.openai.tool_calls import (
    ToolPlan,
    ToolStream,
    message_dicts,
    parse_tool_calls,
    plan_tools,
)
from segserve.outputs import RequestOutput
from segserve.sampling_params import SamplingParams

logger = logging.getLogger("segserve")


@dataclass
class ApiError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def response(self) -> JSONResponse:
        info = p.ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return JSONResponse(p.ErrorResponse(error=info).model_dump(), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


_PARAM_NAMES = ("n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "stop",
                "stop_token_ids", "seed", "prompt", "messages")


def _param_of(message: str) -> str | None:
    """The request field an engine ``ValueError`` message is about (its messages start with the name)."""
    first = message.split(" ", 1)[0]
    return first if first in _PARAM_NAMES else None


def sampling_params(
    req: p.SamplingFields, max_tokens: int | None, tools: ToolPlan | None = None
) -> SamplingParams:
    """``SamplingParams`` of a request. Raises ApiError(400) naming the field and its allowed range.

    The output constraint comes from ``response_format`` / ``structured_outputs``, or from ``tools``
    (``tool_choice`` required or named); asking for both is refused.
    """
    try:
        constraint = structured_outputs_of(req.response_format, req.structured_outputs,
                                           tools.constraint if tools is not None else None)
    except FieldError as exc:
        raise bad_request(str(exc), exc.param) from None
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise bad_request(f"{name}={getattr(req, name)} is not supported (only 0)", name)
    optional = {k: v for k, v in (("temperature", req.temperature), ("top_p", req.top_p),
                                  ("top_k", req.top_k), ("min_p", req.min_p)) if v is not None}
    try:
        return SamplingParams(n=req.n, max_tokens=max_tokens, stop=req.stop, seed=req.seed,
                              min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
                              stop_token_ids=req.stop_token_ids, structured_outputs=constraint,
                              **optional)
    except ValueError as exc:
        raise bad_request(str(exc), _param_of(str(exc))) from None


async def _wait_disconnect(request: Request) -> None:
    """Return when the client has gone (the body is already read, so ``receive`` waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(stream: OutputStream, request: Request) -> AsyncIterator[RequestOutput]:
    """Iterate ``stream`` while the client is connected; abort the request if the client leaves or the
    consumer stops early (after vLLM's ``iterate_with_cancellation``)."""
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    nxt = None
    try:
        while True:
            nxt = asyncio.ensure_future(anext(stream, None))
            done, _ = await asyncio.wait({nxt, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                logger.info("client of %s disconnected", stream.request_id)
                return
            out, nxt = nxt.result(), None
            if out is None:
                return
            yield out
    finally:
        # Cancelling (not just dropping) pending tasks keeps them alive until they finish unwinding.
        for task in (watcher, nxt):
            if task is not None:
                task.cancel()
        stream.abort_if_unfinished()


def _sse(model: p.BaseModel | dict) -> str:
    body = model if isinstance(model, p.BaseModel) else p.ErrorResponse(**model)
    body = body.model_dump_json()
    return f"data: {body}\n\n"


def _usage(out: RequestOutput) -> p.UsageInfo:
    completion = sum(len(c.token_ids) for c in out.outputs)
    return p.usage_info(len(out.prompt_token_ids), completion, out.num_cached_tokens)


class OpenAIServing:
    """Handlers for ``/v1/completions`` and ``/v1/chat/completions``.

    Args:
        engine: the running async engine.
        served_model_names: names clients may send as ``model``; the first is the one reported.
    """

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str],
                 tool_parser: str | None = None) -> None:
        self.engine = engine
        self.names = served_model_names
        self.tool_parser = tool_parser  # set with --enable-auto-tool-choice; enables tool_choice "auto"
        self.llm = engine.engine  # read-only here: tokenizer, chat template, max_model_len
        self.max_model_len = self.llm.max_model_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves {self.names}",
                           param="model", code="model_not_found")

    # ---- prompts --------------------------------------------------------------------------------------

    def completion_prompt_ids(self, req: p.CompletionRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request(f"prompt holds {len(prompt)} prompts; send one prompt per request",
                                  "prompt")
            prompt = prompt[0]
        try:
            return self.llm.tokenize(prompt)[1]
        except ValueError as exc:
            raise bad_request(str(exc), "prompt") from None

    def chat_prompt_ids(self, req: p.ChatCompletionRequest, tools: list[dict] | None = None) -> list[int]:
        from segserve.engine.llm import chat_prompt_ids

        if not req.messages:
            raise bad_request("messages is empty; at least one message is needed", "messages")
        messages = message_dicts(req.messages)
        try:
            return chat_prompt_ids(self.llm, messages, tools=tools)
        except Exception as exc:  # noqa: BLE001 - template errors come in many types; all are the client's
            message = f"messages could not be rendered with the chat template: {exc}"
            raise bad_request(message, "messages") from None

    def check_length(self, num_prompt: int, max_tokens: int | None, prompt_param: str) -> None:
        """ApiError(400) when the prompt, or prompt + ``max_tokens``, exceeds ``max_model_len``."""
        limit = self.max_model_len
        if num_prompt > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens; the prompt has "
                              f"{num_prompt} tokens", prompt_param)
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens; you requested "
                              f"{num_prompt + max_tokens} ({num_prompt} in the prompt, {max_tokens} "
                              f"for the completion)", "max_tokens")

    async def _start(self, prompt_ids: list[int], params: SamplingParams, prefix: str,
                     req: p.SamplingFields) -> OutputStream:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            return await self.engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, params)
        except QueueFullError as exc:
            raise ApiError(503, str(exc), type="server_overloaded", code="queue_full") from None
        except EngineDeadError as exc:
            raise ApiError(503, str(exc), type="server_error", code="engine_dead") from None
        except ValueError as exc:
            message = str(exc)
            if message.startswith("structured_outputs") and req.response_format is not None:
                # The client sent response_format: name its field, not the engine's.
                message = message.replace("structured_outputs.json", "response_format.json_schema.schema", 1)
                raise bad_request(message, "response_format") from None
            param = "structured_outputs" if message.startswith("structured_outputs") else _param_of(message)
            raise bad_request(message, param) from None

    # ---- completions --------------------------------------------------------------------------------

    async def completions(self, req: p.CompletionRequest, raw: Request):
        self.check_model(req.model)
        if req.echo or req.logprobs is not None:
            raise bad_request("echo and logprobs are not supported by this server",
                              "echo" if req.echo else "logprobs")
        if req.best_of not in (None, req.n):
            raise bad_request(f"best_of={req.best_of} is not supported (only best_of == n)", "best_of")
        params = sampling_params(req, req.max_tokens)
        prompt_ids = await asyncio.to_thread(self.completion_prompt_ids, req)
        self.check_length(len(prompt_ids), req.max_tokens, "prompt")
        stream = await self._start(prompt_ids, params, "cmpl", req)
        model = self.names[0]
        if req.stream:
            events = _completion_events(until_disconnected(stream, raw), stream.request_id, model,
                                        req.include_usage)
            return StreamingResponse(_guard(events), media_type="text/event-stream")
        final = await _last(until_disconnected(stream, raw))
        choices = [p.CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason,
                                      stop_reason=c.stop_reason) for c in final.outputs]
        return p.CompletionResponse(id=stream.request_id, model=model, choices=choices, usage=_usage(final))

    # ---- chat -------------------------------------------------------------------------------------------

    async def chat(self, req: p.ChatCompletionRequest, raw: Request):
        self.check_model(req.model)
        if req.logprobs or req.top_logprobs:
            raise bad_request("logprobs are not supported by this server", "logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        try:
            plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_parser)
        except FieldError as exc:
            raise bad_request(str(exc), exc.param) from None
        params = sampling_params(req, max_tokens, plan)
        prompt_ids = await asyncio.to_thread(self.chat_prompt_ids, req, plan.tools)
        self.check_length(len(prompt_ids), max_tokens, "messages")
        stream = await self._start(prompt_ids, params, "chatcmpl", req)
        model = self.names[0]
        if req.stream:
            events = _chat_events(until_disconnected(stream, raw), stream.request_id, model, req.n,
                                  req.include_usage, plan)
            return StreamingResponse(_guard(events), media_type="text/event-stream")
        final = await _last(until_disconnected(stream, raw))
        choices = [_chat_choice(c, plan) for c in final.outputs]
        return p.ChatCompletionResponse(id=stream.request_id, model=model, choices=choices,
                                        usage=_usage(final))


def _chat_choice(c, plan: ToolPlan) -> p.ChatChoice:
    """One finished choice: content, or content and ``tool_calls`` parsed as the plan says."""
    content, calls = parse_tool_calls(plan, c.text)
    return p.ChatChoice(index=c.index, message=p.AssistantMessage(content=content, tool_calls=calls),
                        finish_reason=_tool_finish(c.finish_reason, bool(calls)), stop_reason=c.stop_reason)


def _tool_finish(finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's ``tool_calls`` finish reason for an output that ended normally in tool calls."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The final output of a request (the client may leave first: then the request was aborted)."""
    final = None
    try:
        async for out in outputs:
            final = out
    except EngineDeadError as exc:
        raise ApiError(503, str(exc), type="server_error", code="engine_dead") from None
    if final is None or not final.finished:
        raise ApiError(499, "the client closed the connection; the request was aborted", code="aborted")
    return final


async def _guard(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """End a stream cleanly: an engine failure becomes an error event; ``[DONE]`` always closes it."""
    try:
        async for event in events:
            yield event
    except EngineDeadError as exc:
        yield _sse({"error": {"message": str(exc), "type": "server_error", "code": "engine_dead"}})
    yield "data: [DONE]\n\n"


class _Deltas:
    """Text sent so far per completion index; ``take`` returns the unsent suffix (UTF-8 safe: the
    detokenizer only grows ``text`` by whole characters)."""

    def __init__(self) -> None:
        self.sent: dict[int, int] = {}
        self.done: set[int] = set()

    def take(self, index: int, text: str) -> str:
        start = self.sent.get(index, 0)
        self.sent[index] = len(text)
        return text[start:]


async def _completion_events(outputs: AsyncIterator[RequestOutput], rid: str, model: str,
                             include_usage: bool) -> AsyncIterator[str]:
    deltas, last = _Deltas(), None
    async for out in outputs:
        last = out
        choices = [_completion_delta(deltas, c) for c in out.outputs]
        choices = [c for c in choices if c is not None]
        if choices:
            yield _sse(p.CompletionResponse(id=rid, model=model, choices=choices))
    if include_usage and last is not None and last.finished:
        yield _sse(p.CompletionResponse(id=rid, model=model, choices=[], usage=_usage(last)))


def _completion_delta(deltas: _Deltas, c) -> p.CompletionChoice | None:
    if c.index in deltas.done:
        return None
    text = deltas.take(c.index, c.text)
    if c.finish_reason is not None:
        deltas.done.add(c.index)
    elif not text:
        return None
    return p.CompletionChoice(index=c.index, text=text, finish_reason=c.finish_reason,
                              stop_reason=c.stop_reason)


async def _chat_events(outputs: AsyncIterator[RequestOutput], rid: str, model: str, n: int,
                       include_usage: bool, plan: ToolPlan) -> AsyncIterator[str]:
    chunk: Callable[..., str] = lambda choices, usage=None: _sse(  # noqa: E731 - local shorthand
        p.ChatCompletionChunk(id=rid, model=model, choices=choices, usage=usage))
    # OpenAI opens each choice with the role and an empty content.
    yield chunk([p.ChatStreamChoice(index=i, delta=p.DeltaMessage(role="assistant", content=""))
                 for i in range(n)])
    tools = {i: ToolStream(plan) for i in range(n)}
    done, last = set(), None
    async for out in outputs:
        last = out
        choices = []
        for c in out.outputs:
            if c.index in done:
                continue
            streamer = tools[c.index]
            finished = c.finish_reason is not None
            content, calls = streamer.finish(c.text) if finished else streamer.update(c.text)
            if finished:
                done.add(c.index)
            elif content is None and not calls:
                continue
            delta = p.DeltaMessage(content=content, tool_calls=calls or None)
            reason = _tool_finish(c.finish_reason, bool(streamer.calls)) if finished else None
            choices.append(p.ChatStreamChoice(index=c.index, delta=delta, finish_reason=reason))
        if choices:
            yield chunk(choices)
    if include_usage and last is not None and last.finished:
        yield chunk([], _usage(last))
