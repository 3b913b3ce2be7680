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

from fastapi import Request
from fastapi.responses import StreamingResponse

from segserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    OutputStream,
    QueueFullError,
)
from segserve.entrypoints.openai import protocol as p
from segserve.entrypoints.openai.errors import ApiError, bad_request, engine_error, internal_error
from segserve.entrypoints.openai.limits import max_prompt_chars, printable
from segserve.outputs import RequestOutput
from segserve.sampling_params import SamplingParams

logger = logging.getLogger("segserve")


_PARAM_NAMES = ("n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "stop",
                "stop_token_ids", "seed", "prompt", "messages")


def _short(exc: Exception) -> str:
    """An engine ``ValueError`` as a client message: its values can be a client's giant ``stop`` list."""
    return printable(str(exc), 200)


def _param_of(message: str) -> str | None:
    """The request field an engine ``ValueError`` message is about (its messages start with the name)."""
    first = message.split(" ", 1)[0]
    return first if first in _PARAM_NAMES else None


def sampling_params(req: p.SamplingFields, max_tokens: int | None) -> SamplingParams:
    """``SamplingParams`` of a request. Raises ApiError(400) naming the field and its allowed range."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise bad_request(f"{name}={getattr(req, name)} is not supported (only 0)", name)
    optional = {k: v for k, v in (("temperature", req.temperature), ("top_p", req.top_p),
                                  ("top_k", req.top_k), ("min_p", req.min_p)) if v is not None}
    try:
        return SamplingParams(n=req.n, max_tokens=max_tokens, stop=req.stop, seed=req.seed,
                              min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
                              stop_token_ids=req.stop_token_ids, **optional)
    except ValueError as exc:
        raise bad_request(_short(exc), _param_of(str(exc))) from None


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
        salt_by_api_key: salt every request's prefix-cache hashes by its API key (``tenant_salt``).
    """

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str],
                 salt_by_api_key: bool = False) -> None:
        self.engine = engine
        self.salt_by_api_key = salt_by_api_key
        self.names = served_model_names
        self.llm = engine.engine  # read-only here: tokenizer, chat template, max_model_len
        self.max_model_len = self.llm.max_model_len
        self.max_prompt_chars = max_prompt_chars(self.llm.tokenizer, self.max_model_len)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise ApiError(404, f"The model `{printable(name)}` does not exist; this server serves "
                           f"{self.names}", param="model", code="model_not_found")

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """ApiError(400) for a text too long to fit ``max_model_len`` tokens, before tokenizing it."""
        if num_chars > self.max_prompt_chars:
            verb = "have" if param == "messages" else "has"
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens; the "
                              f"{param} {verb} {num_chars} characters, more than any text of "
                              f"{self.max_model_len} tokens can have ({self.max_prompt_chars})", param)

    def check_top_k(self, req: p.SamplingFields) -> None:
        """ApiError(400) for ``top_k`` beyond the vocabulary, even when greedy decoding ignores it."""
        vocab = self.llm.loaded.config.vocab_size
        if req.top_k is not None and req.top_k > vocab:
            raise bad_request(f"top_k must be 0 or -1 (disabled) or in [1, {vocab}] (the vocabulary size), "
                              f"got {req.top_k}", "top_k")

    def check_servable(self, params: SamplingParams) -> None:
        """ApiError(400) for a request no amount of waiting lets in: ``n`` above the waiting queue."""
        limit = self.engine.max_waiting_requests
        if params.n > limit:
            raise bad_request(f"n={params.n} can never be served: it is above the waiting-queue capacity "
                              f"max_waiting_requests={limit}", "n")

    # ---- prompts --------------------------------------------------------------------------------------

    def completion_prompt(self, req: p.CompletionRequest) -> str | list[int]:
        """The one prompt of a completion request, checked for length before any tokenizing."""
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request(f"prompt holds {len(prompt)} prompts; send one prompt per request",
                                  "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt), "prompt")
        else:
            self.check_length(len(prompt), req.max_tokens, "prompt")
        return prompt

    def completion_prompt_ids(self, prompt: str | list[int]) -> list[int]:
        try:
            return self.llm.tokenize(prompt)[1]
        except ValueError as exc:
            raise bad_request(_short(exc), "prompt") from None

    def chat_messages(self, req: p.ChatCompletionRequest) -> list[dict[str, str]]:
        """The conversation as template input, checked for length before rendering."""
        if not req.messages:
            raise bad_request("messages is empty; at least one message is needed", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        self.check_prompt_chars(sum(len(m["content"]) + len(m["role"]) for m in messages), "messages")
        return messages

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        from segserve.engine.llm import chat_prompt_ids

        try:
            return chat_prompt_ids(self.llm, messages)
        except Exception as exc:  # noqa: BLE001 - template errors come in many types; all are the client's
            message = f"messages could not be rendered with the chat template: {printable(str(exc), 200)}"
            raise bad_request(message, "messages") from None

    def check_length(self, num_prompt: int, max_tokens: int | None, prompt_param: str) -> None:
        """ApiError(400) unless the prompt leaves room for the completion within ``max_model_len``.

        One rule whatever ``max_tokens`` is (vLLM's): prompt + max(``max_tokens``, 1) <= ``max_model_len``;
        ``max_tokens`` null asks for at least one token too.
        """
        limit = self.max_model_len
        if num_prompt >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens; the prompt has "
                              f"{num_prompt} tokens, which leaves no room for the completion (at least "
                              "1 token)", prompt_param)
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens; you requested "
                              f"{num_prompt + max_tokens} ({num_prompt} in the prompt, {max_tokens} "
                              f"for the completion)", "max_tokens")

    def salt_of(self, req: p.SamplingFields, raw: Request) -> str | None:
        """The request's cache salt: its ``cache_salt``, prefixed by a digest of its API key when the
        server salts by key (``--cache-salt-by-api-key``), so no tenant can pick another's salt."""
        if not self.salt_by_api_key:
            return req.cache_salt
        return tenant_salt(raw.headers.get("authorization"), req.cache_salt)

    async def _start(self, prompt_ids: list[int], params: SamplingParams, prefix: str,
                     cache_salt: str | None) -> OutputStream:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            return await self.engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, params,
                                                 cache_salt=cache_salt)
        except QueueFullError as exc:
            raise ApiError(503, str(exc), type="server_overloaded", code="queue_full") from None
        except EngineDeadError as exc:
            raise engine_error(exc) from None
        except ValueError as exc:
            raise bad_request(_short(exc), _param_of(str(exc))) from None

    # ---- completions --------------------------------------------------------------------------------

    async def completions(self, req: p.CompletionRequest, raw: Request):
        self.check_model(req.model)
        if req.echo or req.logprobs is not None:
            raise bad_request("echo and logprobs are not supported by this server",
                              "echo" if req.echo else "logprobs")
        if req.best_of not in (None, req.n):
            raise bad_request(f"best_of={req.best_of} is not supported (only best_of == n)", "best_of")
        self.check_top_k(req)
        params = sampling_params(req, req.max_tokens)
        self.check_servable(params)
        # Tokenizing a long prompt takes a while: off the event loop, so other requests go on.
        prompt_ids = await asyncio.to_thread(self.completion_prompt_ids, self.completion_prompt(req))
        self.check_length(len(prompt_ids), req.max_tokens, "prompt")
        stream = await self._start(prompt_ids, params, "cmpl", self.salt_of(req, raw))
        model = self.names[0]
        if req.stream:
            events = _completion_events(until_disconnected(stream, raw), stream.request_id, model,
                                        req.include_usage)
            return StreamingResponse(_guard(events, stream), media_type="text/event-stream")
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
        self.check_top_k(req)
        params = sampling_params(req, max_tokens)
        self.check_servable(params)
        prompt_ids = await asyncio.to_thread(self.chat_prompt_ids, self.chat_messages(req))
        self.check_length(len(prompt_ids), max_tokens, "messages")
        stream = await self._start(prompt_ids, params, "chatcmpl", self.salt_of(req, raw))
        model = self.names[0]
        if req.stream:
            events = _chat_events(until_disconnected(stream, raw), stream.request_id, model, req.n,
                                  req.include_usage)
            return StreamingResponse(_guard(events, stream), media_type="text/event-stream")
        final = await _last(until_disconnected(stream, raw))
        choices = [p.ChatChoice(index=c.index, message=p.AssistantMessage(content=c.text),
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                   for c in final.outputs]
        return p.ChatCompletionResponse(id=stream.request_id, model=model, choices=choices,
                                        usage=_usage(final))


def tenant_salt(authorization: str | None, cache_salt: str | None) -> str:
    """A cache salt private to the API key of an ``Authorization: Bearer KEY`` header (no header: one
    shared anonymous tenant), combined with the client's own ``cache_salt``. The key enters as a
    SHA-256 digest, so it is never stored in the block hashes in clear."""
    import hashlib

    key = ""
    if authorization and authorization[:7].lower() == "bearer ":
        key = authorization[7:].strip()
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    return f"key:{digest}" if cache_salt is None else f"key:{digest}:{cache_salt}"


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The final output of a request (the client may leave first: then the request was aborted)."""
    final = None
    try:
        async for out in outputs:
            final = out
    except EngineDeadError as exc:
        raise engine_error(exc) from None
    if final is None or not final.finished:
        raise ApiError(499, "the client closed the connection; the request was aborted", code="aborted")
    return final


async def _guard(events: AsyncIterator[str], stream: OutputStream) -> AsyncIterator[str]:
    """End a stream cleanly: an engine failure becomes an error event; ``[DONE]`` always closes it;
    the request is aborted if the events stopped before it finished (its blocks go back at once)."""
    try:
        async for event in events:
            yield event
    except EngineDeadError as exc:
        yield _sse_error(engine_error(exc))
    except Exception as exc:  # noqa: BLE001 - the stream has started: the client gets an error event
        yield _sse_error(internal_error(exc))
    finally:
        stream.abort_if_unfinished()
    yield "data: [DONE]\n\n"


def _sse_error(error: ApiError) -> str:
    info = p.ErrorInfo(message=error.message, type=error.type, param=error.param, code=error.code)
    return _sse(p.ErrorResponse(error=info))


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
                       include_usage: bool) -> AsyncIterator[str]:
    chunk: Callable[..., str] = lambda choices, usage=None: _sse(  # noqa: E731 - local shorthand
        p.ChatCompletionChunk(id=rid, model=model, choices=choices, usage=usage))
    # OpenAI opens each choice with the role and an empty content.
    yield chunk([p.ChatStreamChoice(index=i, delta=p.DeltaMessage(role="assistant", content=""))
                 for i in range(n)])
    deltas, last = _Deltas(), None
    async for out in outputs:
        last = out
        choices = []
        for c in out.outputs:
            d = _completion_delta(deltas, c)
            if d is not None:
                delta = p.DeltaMessage(content=d.text) if d.text else p.DeltaMessage()
                choices.append(p.ChatStreamChoice(index=d.index, delta=delta, finish_reason=d.finish_reason))
        if choices:
            yield chunk(choices)
    if include_usage and last is not None and last.finished:
        yield chunk([], _usage(last))
