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
from fastapi.responses import StreamingResponse

from segserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    OutputStream,
    QueueFullError,
)
from segserve.entrypoints.openai import protocol as p
from segserve.entrypoints.openai.errors import ApiError, bad_request, engine_error, internal_error
from segserve.entrypoints.openai.fields import (
    REFUSED_CHAT,
    REFUSED_COMPLETION,
    REFUSED_MESSAGE,
    unhonoured_field,
)
from segserve.entrypoints.openai.limits import max_prompt_chars, printable
from segserve.entrypoints.openai.logprobs_format import CompletionLogprobsBuilder, chat_logprobs
from segserve.entrypoints.openai.structured import FieldError, structured_outputs_of
from segserve.entrypoints.openai.tool_calls import (
    ToolPlan,
    ToolStream,
    message_dicts,
    parse_tool_calls,
    plan_tools,
)
from segserve.outputs import RequestOutput
from segserve.sampling_params import MAX_LOGPROBS, SamplingParams

logger = logging.getLogger("segserve")


_PARAM_NAMES = ("n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "stop",
                "stop_token_ids", "seed", "prompt", "messages", "logprobs", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words",
                "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens")


def _short(exc: Exception) -> str:
    """An engine ``ValueError`` as a client message: its values can be a client's giant ``stop`` list."""
    return printable(str(exc), 200)


def _param_of(message: str) -> str | None:
    """The request field an engine ``ValueError`` message is about (its messages start with the name)."""
    first = message.split(" ", 1)[0]
    return first if first in _PARAM_NAMES else None


def sampling_params(req: p.SamplingFields, max_tokens: int | None, logprobs: int | None = None,
                    prompt_logprobs: int | None = None, tools: ToolPlan | None = None) -> SamplingParams:
    """``SamplingParams`` of a request. Raises ApiError(400) naming the field and its allowed range.

    The output constraint comes from ``response_format`` / ``structured_outputs``, or from ``tools``
    (``tool_choice`` required or named); asking for both is refused.
    """
    try:
        constraint = structured_outputs_of(req.response_format, req.structured_outputs,
                                           tools.constraint if tools is not None else None)
    except FieldError as exc:
        raise bad_request(str(exc), exc.param) from None
    optional = {k: v for k, v in (("temperature", req.temperature), ("top_p", req.top_p),
                                  ("top_k", req.top_k), ("min_p", req.min_p)) if v is not None}
    try:
        return SamplingParams(n=req.n, max_tokens=max_tokens, stop=req.stop, seed=req.seed,
                              min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
                              stop_token_ids=req.stop_token_ids, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, structured_outputs=constraint,
                              **req.logits_kwargs(), **optional)
    except ValueError as exc:
        raise bad_request(_short(exc), _param_of(str(exc))) from None


def check_fields(req: p.BaseModel, refused: dict[str, str]) -> None:
    """ApiError(400) naming the first field of ``req`` that is unknown or not honoured."""
    hit = unhonoured_field(req, refused)
    if hit is not None:
        raise bad_request(hit[1], hit[0])


async def _wait_disconnect(request: Request) -> None:
    """Return when the client has gone (the body is already read, so ``receive`` waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _pump(i: int, stream: OutputStream, q: asyncio.Queue) -> None:
    """Forward one stream's outputs (or its exception) into ``q``; ``(i, None)`` marks its end."""
    try:
        async for out in stream:
            q.put_nowait((i, out))
    except Exception as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
        q.put_nowait((i, exc))
    q.put_nowait((i, None))


async def until_disconnected(streams: list[OutputStream], request: Request
                             ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) of every stream as outputs arrive (one stream per prompt), while the
    client is connected; every unfinished request is aborted when the client leaves or the consumer
    stops early (after vLLM's ``merge_async_iterators`` and ``iterate_with_cancellation``)."""
    q: asyncio.Queue = asyncio.Queue()
    pumps = [asyncio.ensure_future(_pump(i, s, q)) for i, s in enumerate(streams)]
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    nxt = None
    try:
        left = len(streams)
        while left:
            nxt = asyncio.ensure_future(q.get())
            done, _ = await asyncio.wait({nxt, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                logger.info("client of %s disconnected", streams[0].request_id)
                return
            (i, item), nxt = nxt.result(), None
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for stream in streams:
            stream.abort_if_unfinished()
        # Cancelling (not just dropping) pending tasks keeps them alive until they finish unwinding.
        for task in (watcher, nxt, *pumps):
            if task is not None:
                task.cancel()


def _sse(model: p.BaseModel | dict) -> str:
    body = model if isinstance(model, p.BaseModel) else p.ErrorResponse(**model)
    body = body.model_dump_json()
    return f"data: {body}\n\n"


@dataclass
class _Prompt:
    """One prompt of a request: its text (decoded when token ids were sent) and token ids."""

    text: str
    ids: list[int]


def _usage(outs: list[RequestOutput], generated: bool = True) -> p.UsageInfo:
    completion = sum(len(c.token_ids) for out in outs for c in out.outputs) if generated else 0
    return p.usage_info(sum(len(o.prompt_token_ids) for o in outs), completion,
                        sum(o.num_cached_tokens for o in outs))


@dataclass
class _CompletionShape:
    """What a completions request asks its choices to hold (``echo``, ``logprobs``, ``max_tokens: 0``)."""

    echo: bool
    logprobs: int | None
    echo_only: bool  # echo with max_tokens 0: the prompt alone; the one token generated is dropped
    n: int

    def index(self, prompt_index: int, completion_index: int) -> int:
        """OpenAI's choice order: prompt by prompt, then completion."""
        return prompt_index * self.n + completion_index

    def tokens(self, out: RequestOutput, c) -> tuple[list[int], list[dict[int, float] | None]]:
        """A choice's token ids and logprob positions (the prompt's first under echo)."""
        ids, pos = [], []
        if self.echo:
            ids += out.prompt_token_ids
            known = list(out.prompt_logprobs or [])
            pos += known + [None] * (len(out.prompt_token_ids) - len(known))
        if not self.echo_only:
            ids += c.token_ids
            pos += list(c.logprobs or [])
        return ids, pos


class OpenAIServing:
    """Handlers for ``/v1/completions`` and ``/v1/chat/completions``.

    Args:
        engine: the running async engine.
        served_model_names: names clients may send as ``model``; the first is the one reported.
        salt_by_api_key: salt every request's prefix-cache hashes by its API key (``tenant_salt``).
        tool_parser: the tool-call parser of ``tool_choice: "auto"`` (``"hermes"``), or None.
    """

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str],
                 salt_by_api_key: bool = False, tool_parser: str | None = None) -> None:
        self.engine = engine
        self.tool_parser = tool_parser  # set with --enable-auto-tool-choice; enables tool_choice "auto"
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

    def decode_token(self, token_id: int) -> str:
        """One token's text, as vLLM writes it in logprobs (special tokens kept)."""
        return self.llm.tokenizer.decode([token_id])

    # ---- prompts --------------------------------------------------------------------------------------

    def completion_prompts(self, req: p.CompletionRequest) -> list[_Prompt]:
        """Every prompt of the request (a string, token ids, or a non-empty list of either), each
        checked for length before it is tokenized (called off the event loop: tokenizing takes a while)."""
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        elif not prompt:
            raise bad_request("prompt is empty (0 prompts); at least 1 is needed", "prompt")
        else:
            prompts = list(prompt)
        for one in prompts:
            if isinstance(one, str):
                self.check_prompt_chars(len(one), "prompt")
            else:
                self.check_length(len(one), req.max_tokens, "prompt")
        out = []
        for one in prompts:
            try:
                text, ids = self.llm.tokenize(one)
            except ValueError as exc:
                raise bad_request(_short(exc), "prompt") from None
            out.append(_Prompt(text if text is not None else self.llm.tokenizer.decode(ids), ids))
        return out

    def chat_messages(self, req: p.ChatCompletionRequest) -> list[dict[str, str]]:
        """The conversation as template input, its fields checked and its length bounded before
        rendering."""
        if not req.messages:
            raise bad_request("messages is empty; at least one message is needed", "messages")
        for i, m in enumerate(req.messages):
            check_fields(m, REFUSED_MESSAGE)
            problem = m.unsupported_part()
            if problem is not None:
                raise bad_request(f"messages[{i}].content: {problem}", "messages")
        messages = message_dicts(req.messages)
        self.check_prompt_chars(sum(len(m["content"]) + len(m["role"]) for m in messages), "messages")
        return messages

    def chat_prompt_ids(self, req: p.ChatCompletionRequest, messages: list[dict[str, str]],
                        tools: list[dict] | None = None) -> list[int]:
        from segserve.engine.llm import chat_prompt_ids

        try:
            return chat_prompt_ids(self.llm, messages, req.add_generation_prompt,
                                   req.chat_template_kwargs, tools=tools)
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
                     cache_salt: str | None, by_format: bool = False) -> OutputStream:
        """Add one request; ``by_format``: its constraint came from ``response_format`` (named in errors)."""
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            return await self.engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, params,
                                                 cache_salt=cache_salt)
        except QueueFullError as exc:
            raise ApiError(503, str(exc), type="server_overloaded", code="queue_full") from None
        except EngineDeadError as exc:
            raise engine_error(exc) from None
        except ValueError as exc:
            message = _short(exc)
            if message.startswith("structured_outputs") and by_format:
                # The client sent response_format: name its field, not the engine's.
                message = message.replace("structured_outputs.json", "response_format.json_schema.schema", 1)
                raise bad_request(message, "response_format") from None
            param = "structured_outputs" if message.startswith("structured_outputs") else _param_of(message)
            raise bad_request(message, param) from None

    async def _start_all(self, prompts: list[list[int]], params: SamplingParams, prefix: str,
                         cache_salt: str | None, by_format: bool = False) -> list[OutputStream]:
        """One engine request per prompt; if one is refused, the ones already added are aborted."""
        streams: list[OutputStream] = []
        try:
            for ids in prompts:
                streams.append(await self._start(ids, params, prefix, cache_salt, by_format))
        except BaseException:
            for stream in streams:
                stream.abort_if_unfinished()
            raise
        return streams

    # ---- completions --------------------------------------------------------------------------------

    async def completions(self, req: p.CompletionRequest, raw: Request):
        self.check_model(req.model)
        check_fields(req, REFUSED_COMPLETION)
        if req.best_of not in (None, req.n):
            raise bad_request(f"best_of={req.best_of} is not supported (only best_of == n)", "best_of")
        shape = _CompletionShape(req.echo, req.logprobs, req.echo and req.max_tokens == 0, req.n)
        # max_tokens 0 with echo: generate one token and drop it (vLLM 0.32 does the same).
        max_tokens = 1 if shape.echo_only else req.max_tokens
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        self.check_top_k(req)
        params = sampling_params(req, max_tokens, req.logprobs, prompt_logprobs)
        self.check_servable(params)
        prompts = await asyncio.to_thread(self.completion_prompts, req)
        for prompt in prompts:
            self.check_length(len(prompt.ids), max_tokens, "prompt")
        streams = await self._start_all([x.ids for x in prompts], params, "cmpl", self.salt_of(req, raw),
                                        req.response_format is not None)
        rid, model = streams[0].request_id, self.names[0]
        outputs = until_disconnected(streams, raw)
        if req.stream:
            events = self._completion_events(outputs, rid, model, shape, prompts, req)
            return StreamingResponse(_guard(events, streams), media_type="text/event-stream")
        finals = await _last_each(outputs, len(streams))
        choices = [self._completion_choice(shape, i, prompts[i], out, c)
                   for i, out in enumerate(finals) for c in out.outputs]
        return p.CompletionResponse(id=rid, model=model, choices=choices,
                                    usage=_usage(finals, not shape.echo_only))

    def _completion_choice(self, shape: _CompletionShape, i: int, prompt: _Prompt, out: RequestOutput, c
                           ) -> p.CompletionChoice:
        text = (prompt.text if shape.echo else "") + ("" if shape.echo_only else c.text)
        logprobs = None
        if shape.logprobs is not None:
            logprobs = CompletionLogprobsBuilder(self.decode_token).add(*shape.tokens(out, c))
        return p.CompletionChoice(index=shape.index(i, c.index), text=text,
                                  logprobs=logprobs, finish_reason=c.finish_reason,
                                  stop_reason=c.stop_reason)

    async def _completion_events(self, outputs: AsyncIterator[tuple[int, RequestOutput]], rid: str,
                                 model: str, shape: _CompletionShape, prompts: list[_Prompt],
                                 req: p.CompletionRequest) -> AsyncIterator[str]:
        sent: dict[int, _Sent] = {}
        last: dict[int, RequestOutput] = {}
        async for i, out in outputs:
            last[i] = out
            choices = []
            for c in out.outputs:
                key = shape.index(i, c.index)
                state = sent.setdefault(key, _Sent(CompletionLogprobsBuilder(self.decode_token)))
                choice = state.completion_delta(shape, prompts[i], out, c, key)
                if choice is not None:
                    choices.append(choice)
            if choices:
                usage = _usage(list(last.values()), not shape.echo_only) if req.continuous_usage else None
                yield _sse(p.CompletionResponse(id=rid, model=model, choices=choices, usage=usage))
        finals = list(last.values())
        if req.include_usage and len(finals) == len(prompts) and all(o.finished for o in finals):
            yield _sse(p.CompletionResponse(id=rid, model=model, choices=[],
                                            usage=_usage(finals, not shape.echo_only)))

    # ---- chat -------------------------------------------------------------------------------------------

    async def chat(self, req: p.ChatCompletionRequest, raw: Request):
        self.check_model(req.model)
        check_fields(req, REFUSED_CHAT)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        top = req.top_logprobs or 0
        if req.logprobs and not 0 <= top <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be an int in [0, {MAX_LOGPROBS}], got {top}",
                              "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        self.check_top_k(req)
        try:
            plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_parser)
        except FieldError as exc:
            raise bad_request(str(exc), exc.param) from None
        params = sampling_params(req, max_tokens, top if req.logprobs else None, tools=plan)
        self.check_servable(params)
        prompt_ids = await asyncio.to_thread(self.chat_prompt_ids, req, self.chat_messages(req), plan.tools)
        self.check_length(len(prompt_ids), max_tokens, "messages")
        streams = await self._start_all([prompt_ids], params, "chatcmpl", self.salt_of(req, raw),
                                        req.response_format is not None)
        rid, model = streams[0].request_id, self.names[0]
        outputs = until_disconnected(streams, raw)
        top_n = top if req.logprobs else None
        if req.stream:
            events = self._chat_events(outputs, rid, model, top_n, req, plan)
            return StreamingResponse(_guard(events, streams), media_type="text/event-stream")
        final = (await _last_each(outputs, 1))[0]
        choices = [_chat_choice(c, plan, self._chat_logprobs(c.token_ids, c.logprobs, top_n))
                   for c in final.outputs]
        return p.ChatCompletionResponse(id=rid, model=model, choices=choices, usage=_usage([final]))

    def _chat_logprobs(self, ids: list[int], positions, top_n: int | None) -> p.ChoiceLogprobs | None:
        if top_n is None:
            return None
        return chat_logprobs(ids, list(positions or []), top_n, self.decode_token)

    async def _chat_events(self, outputs: AsyncIterator[tuple[int, RequestOutput]], rid: str, model: str,
                           top_n: int | None, req: p.ChatCompletionRequest, plan: ToolPlan
                           ) -> AsyncIterator[str]:
        chunk: Callable[..., str] = lambda choices, usage=None: _sse(  # noqa: E731 - local shorthand
            p.ChatCompletionChunk(id=rid, model=model, choices=choices, usage=usage))
        sent: dict[int, _Sent] = {}
        tools: dict[int, ToolStream] = {}
        last = None
        async for _, out in outputs:
            last = out
            choices = []
            for c in out.outputs:
                if plan.mode != "none":  # content and tool calls come from the tool stream
                    choice = _tool_delta(tools.setdefault(c.index, ToolStream(plan)), sent, c)
                    if choice is not None:
                        choices.append(choice)
                    continue
                state = sent.setdefault(c.index, _Sent(None))
                first, done = not state.started, c.finish_reason is not None
                if state.done or not (first or done or len(c.text) > state.chars):
                    continue
                text, ids, pos = state.take(c.text, c.token_ids, list(c.logprobs or []))
                state.done = done
                # The role travels with the first engine output (vLLM 0.32), so a client that
                # times the first chunk with choices measures the prefill.
                delta = p.DeltaMessage(role="assistant" if first else None,
                                       content=text if text or first else None)
                logprobs = self._chat_logprobs(ids, pos, top_n) if ids else None
                choices.append(p.ChatStreamChoice(index=c.index, delta=delta, logprobs=logprobs,
                                                  finish_reason=c.finish_reason))
            if choices:
                yield chunk(choices, _usage([out]) if req.continuous_usage else None)
        if req.include_usage and last is not None and last.finished:
            yield chunk([], _usage([last]))


def _chat_choice(c, plan: ToolPlan, logprobs: p.ChoiceLogprobs | None) -> p.ChatChoice:
    """One finished choice: content, or content and ``tool_calls`` parsed as the plan says."""
    content, calls = parse_tool_calls(plan, c.text)
    return p.ChatChoice(index=c.index, message=p.AssistantMessage(content=content, tool_calls=calls),
                        logprobs=logprobs, finish_reason=_tool_finish(c.finish_reason, bool(calls)),
                        stop_reason=c.stop_reason)


def _tool_finish(finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's ``tool_calls`` finish reason for an output that ended normally in tool calls."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


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
    reason = _tool_finish(c.finish_reason, bool(stream.calls)) if done else None
    return p.ChatStreamChoice(index=c.index, delta=delta, finish_reason=reason)


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


@dataclass
class _Sent:
    """What one choice has streamed so far: characters and tokens (its logprobs builder keeps the
    running text offset)."""

    builder: CompletionLogprobsBuilder | None
    chars: int = 0
    tokens: int = 0
    started: bool = False
    done: bool = False

    def take(self, text: str, ids: list[int], positions: list) -> tuple[str, list[int], list]:
        """The unsent suffix of the text (UTF-8 safe: the detokenizer grows it by whole characters),
        of the token ids and of their logprob positions."""
        new = (text[self.chars:], ids[self.tokens:], positions[self.tokens:])
        self.chars, self.tokens, self.started = len(text), len(ids), True
        return new

    def completion_delta(self, shape: _CompletionShape, prompt: _Prompt, out: RequestOutput, c, index: int
                         ) -> p.CompletionChoice | None:
        """The next chunk's choice, or None when there is nothing to send yet. Under ``echo`` the prompt
        goes out with the first generated token, when its logprobs are complete."""
        done = c.finish_reason is not None
        if self.done or (not done and (shape.echo_only or (shape.echo and not c.token_ids))):
            return None
        text = (prompt.text if shape.echo else "") + ("" if shape.echo_only else c.text)
        if not done and len(text) <= self.chars:
            return None
        new_text, ids, pos = self.take(text, *shape.tokens(out, c))
        self.done = done
        logprobs = self.builder.add(ids, pos) if shape.logprobs is not None and self.builder else None
        return p.CompletionChoice(index=index, text=new_text, logprobs=logprobs,
                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason)


async def _last_each(outputs: AsyncIterator[tuple[int, RequestOutput]], count: int) -> list[RequestOutput]:
    """The final output of each of ``count`` requests, in prompt order (the client may leave first:
    then they were aborted)."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for i, out in outputs:
            finals[i] = out
    except EngineDeadError as exc:
        raise engine_error(exc) from None
    if len(finals) < count or not all(o.finished for o in finals.values()):
        raise ApiError(499, "the client closed the connection; the request was aborted", code="aborted")
    return [finals[i] for i in range(count)]


async def _guard(events: AsyncIterator[str], streams: list[OutputStream]) -> AsyncIterator[str]:
    """End a stream cleanly: an engine failure becomes an error event; ``[DONE]`` always closes it;
    the requests are aborted if the events stopped before they finished (their blocks go back at once)."""
    try:
        async for event in events:
            yield event
    except EngineDeadError as exc:
        yield _sse_error(engine_error(exc))
    except Exception as exc:  # noqa: BLE001 - the stream has started: the client gets an error event
        yield _sse_error(internal_error(exc))
    finally:
        for stream in streams:
            stream.abort_if_unfinished()
    yield "data: [DONE]\n\n"


def _sse_error(error: ApiError) -> str:
    info = p.ErrorInfo(message=error.message, type=error.type, param=error.param, code=error.code)
    return _sse(p.ErrorResponse(error=info))
