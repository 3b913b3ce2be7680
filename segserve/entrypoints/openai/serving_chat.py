"""``POST /v1/chat/completions``: messages rendered with the chat template in; an assistant message,
or its server-sent chunks (the role with the first token, as vLLM 0.32 sends it), out. Tool calls
(``tools``, ``tool_choice``) are planned by ``tool_calls`` and parsed from the text as it streams.
The validation, the engine calls and the stream's end are shared with completions (``serving``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from segserve.entrypoints.openai import protocol as p
from segserve.entrypoints.openai.errors import bad_request
from segserve.entrypoints.openai.fields import REFUSED_CHAT
from segserve.entrypoints.openai.logprobs_format import chat_logprobs
from segserve.entrypoints.openai.serving import (
    OpenAIServing,
    SentSoFar,
    check_fields,
    choice_usage,
    constraint_field,
    guard_stream,
    last_each,
    message_chars,
    narrowing_fields,
    response_id,
    sampling_params,
    sse,
    tokenize_sized,
    until_disconnected,
    usage_of,
)
from segserve.entrypoints.openai.structured import FieldError
from segserve.entrypoints.openai.tool_calls import ToolPlan, ToolStream, parse_tool_calls, plan_tools
from segserve.outputs import RequestOutput
from segserve.sampling_params import MAX_LOGPROBS


async def create_chat_completion(serving: OpenAIServing, req: p.ChatCompletionRequest, raw: Request):
    """``POST /v1/chat/completions``: a ``ChatCompletionResponse``, or a ``StreamingResponse`` of chunks.

    Raises:
        ApiError: a bad field (400, naming it), an unknown model (404), a full queue (503).
    """
    serving.check_model(req.model)
    check_fields(req, REFUSED_CHAT)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    top = req.top_logprobs or 0
    if req.logprobs and not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be an int in [0, {MAX_LOGPROBS}], got {top}",
                          "top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    serving.check_top_k(req)
    try:
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, serving.tool_parser)
    except FieldError as exc:
        raise bad_request(str(exc), exc.param) from None
    params = sampling_params(req, max_tokens, top if req.logprobs else None, tools=plan,
                             max_tokens_field="max_completion_tokens" if req.max_completion_tokens is not None
                             else "max_tokens")
    serving.check_servable(params)
    messages = serving.chat_messages(req)
    # Tools enter the template as JSON schemas, of a size not counted here: rendered off the loop.
    chars = None if plan.tools else message_chars(messages)
    prompt_ids = await tokenize_sized(chars, serving.chat_prompt_ids, req, messages, plan.tools)
    serving.check_length(len(prompt_ids), max_tokens, "messages")
    field = constraint_field(req, plan.constraint is not None)
    given_id = response_id("chatcmpl", raw, req.request_id)
    streams = await serving.start_all([prompt_ids], params, "chatcmpl", serving.salt_of(req, raw), field)
    rid, model = given_id or streams[0].request_id, serving.names[0]
    outputs = until_disconnected(streams, raw, field, narrowing_fields(req))
    top_n = top if req.logprobs else None
    if req.stream:
        events = _chat_events(serving, outputs, rid, model, top_n, req, plan)
        return StreamingResponse(guard_stream(events, streams), media_type="text/event-stream")
    final = (await last_each(outputs, 1))[0]
    choices = [_chat_choice(c, plan, _chat_logprobs(serving, c.token_ids, c.logprobs, top_n))
               for c in final.outputs]
    return p.ChatCompletionResponse(id=rid, model=model, choices=choices, usage=usage_of([final]))


def _chat_logprobs(serving: OpenAIServing, ids: list[int], positions, top_n: int | None
                   ) -> p.ChoiceLogprobs | None:
    if top_n is None:
        return None
    return chat_logprobs(ids, list(positions or []), top_n, serving.decode_token)


async def _chat_events(serving: OpenAIServing, outputs: AsyncIterator[tuple[int, RequestOutput]], rid: str,
                       model: str, top_n: int | None, req: p.ChatCompletionRequest, plan: ToolPlan
                       ) -> AsyncIterator[str]:
    chunk: Callable[..., str] = lambda choices, usage=None: sse(  # noqa: E731 - local shorthand
        p.ChatCompletionChunk(id=rid, model=model, choices=choices, usage=usage))
    sent: dict[int, SentSoFar] = {}
    tools: dict[int, ToolStream] = {}
    logprobs_sent: dict[int, int] = {}  # tool streams: tokens whose logprobs went out, per choice
    last = None
    async for _, out in outputs:
        last = out
        choices = []
        for c in out.outputs:
            if plan.mode != "none":  # content and tool calls come from the tool stream
                choice = _tool_delta(tools.setdefault(c.index, ToolStream(plan)), sent, c)
                if choice is not None:
                    if top_n is not None:  # the tokens since the last chunk, held-back text's included
                        n0 = logprobs_sent.get(c.index, 0)
                        ids, pos = list(c.token_ids[n0:]), list(c.logprobs or [])[n0:]
                        logprobs_sent[c.index] = len(c.token_ids)
                        choice.logprobs = _chat_logprobs(serving, ids, pos, top_n) if ids else None
                    choices.append((choice, c))
                continue
            state = sent.setdefault(c.index, SentSoFar(None))
            first, done = not state.started, c.finish_reason is not None
            if not c.token_ids and not done:
                continue  # a sibling's first token came first: the role waits for this choice's own
            # A step with new tokens sends a chunk even when its text is held back (vLLM 0.32).
            grew = len(c.text) > state.chars or len(c.token_ids) > state.tokens
            if state.done or not (first or done or grew):
                continue
            text, ids, pos = state.take(c.text, c.token_ids, list(c.logprobs or []))
            state.done = done
            # The role travels with the first engine output (vLLM 0.32), so a client that
            # times the first chunk with choices measures the prefill.
            delta = p.DeltaMessage(role="assistant" if first else None,
                                   content=text if text or first or ids else None)
            logprobs = _chat_logprobs(serving, ids, pos, top_n) if ids else None
            choices.append((p.ChatStreamChoice(index=c.index, delta=delta, logprobs=logprobs,
                                               finish_reason=c.finish_reason, stop_reason=c.stop_reason), c))
        for choice, c in choices:  # one choice a chunk, as vLLM streams n > 1
            yield chunk([choice], choice_usage(out, c) if req.continuous_usage else None)
    if req.include_usage and last is not None and last.finished:
        yield chunk([], usage_of([last]))



def _chat_choice(c, plan: ToolPlan, logprobs: p.ChoiceLogprobs | None) -> p.ChatChoice:
    """One finished choice: content, or content and ``tool_calls`` parsed as the plan says."""
    content, calls = parse_tool_calls(plan, c.text)
    return p.ChatChoice(index=c.index, message=p.AssistantMessage(content=content, tool_calls=calls),
                        logprobs=logprobs, finish_reason=_tool_finish(plan, c.finish_reason, bool(calls)),
                        stop_reason=c.stop_reason)


def _tool_finish(plan: ToolPlan, finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's ``tool_calls`` finish reason for an output that ended normally in tool calls the model
    chose (``auto``, ``required``); a named function's call ends with ``stop``, as in OpenAI's API and
    vLLM 0.32."""
    return "tool_calls" if called and finish_reason == "stop" and plan.mode != "named" else finish_reason


def _tool_delta(stream: ToolStream, sent: dict, c) -> p.ChatStreamChoice | None:
    """The next streamed choice of a tool-calling request (role first, as the plain path sends it)."""
    first, done = c.index not in sent, c.finish_reason is not None
    if sent.get(c.index) == "done":
        return None
    content, calls = stream.finish(c.text) if done else stream.update(c.text)
    sent[c.index] = "done" if done else "started"
    if not (first or done or content is not None or calls):
        return None
    delta = p.DeltaMessage(role="assistant" if first else None,
                           content=content if content is not None or not first else "",
                           tool_calls=calls or None)
    reason = _tool_finish(stream.plan, c.finish_reason, bool(stream.calls)) if done else None
    return p.ChatStreamChoice(index=c.index, delta=delta, finish_reason=reason,
                              stop_reason=c.stop_reason if done else None)
