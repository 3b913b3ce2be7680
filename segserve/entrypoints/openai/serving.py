"""What the OpenAI-compatible routes share: validate, build sampling parameters, add the request to
the ``AsyncLLMEngine``, and end its output stream. The routes themselves: ``serving_completion``
(``/v1/completions``) and ``serving_chat`` (``/v1/chat/completions``), as in vLLM.

Streaming follows OpenAI's wire format: ``data: {chunk}\\n\\n`` per event, deltas of the text, a
final chunk with ``finish_reason``, an optional usage chunk (``stream_options.include_usage``) with
empty ``choices``, then ``data: [DONE]``. A client that disconnects (streaming or not) aborts its
request, so its KV blocks return to the pool before the next step.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from segserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    OutputStream,
    QueueFullError,
)
from segserve.entrypoints.openai import protocol as p
from segserve.entrypoints.openai.errors import ApiError, bad_request, engine_error, internal_error
from segserve.entrypoints.openai.fields import REFUSED_MESSAGE, unhonoured_field
from segserve.entrypoints.openai.limits import max_prompt_chars, printable
from segserve.entrypoints.openai.logprobs_format import CompletionLogprobsBuilder
from segserve.entrypoints.openai.structured import FieldError, structured_outputs_of
from segserve.entrypoints.openai.tool_calls import ToolPlan, message_dicts
from segserve.outputs import RequestOutput
from segserve.sampling_params import SamplingParams

logger = logging.getLogger("segserve")


_PARAM_NAMES = ("n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "stop",
                "stop_token_ids", "seed", "prompt", "messages", "logprobs", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words",
                "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens")


def short_error(exc: Exception) -> str:
    """An engine ``ValueError`` as a client message: its values can be a client's giant ``stop`` list, so
    it is cut, but not before 300 characters (at 200 a message about the KV cache lost its advice; the
    error body of a giant value stays under 500 bytes)."""
    return printable(str(exc), 300)


def leading_name(message: str) -> str:
    """The field name our ``ValueError`` messages start with, alone or as ``name=value`` ("": none)."""
    return re.match(r"[a-z_]*", message).group()


def _param_of(message: str) -> str | None:
    """The request field an engine ``ValueError`` message is about (its messages start with the name)."""
    first = leading_name(message)
    return first if first in _PARAM_NAMES else None


def sampling_params(req: p.SamplingFields, max_tokens: int | None, logprobs: int | None = None,
                    prompt_logprobs: int | None = None, tools: ToolPlan | None = None,
                    max_tokens_field: str = "max_tokens") -> SamplingParams:
    """``SamplingParams`` of a request. Raises ApiError(400) naming the field and its allowed range;
    ``max_tokens_field`` is the name the client gave the output limit (chat's ``max_completion_tokens``).

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
        message, param = short_error(exc), _param_of(str(exc))
        if param == "max_tokens" and max_tokens_field != "max_tokens":
            message, param = message.replace("max_tokens", max_tokens_field, 1), max_tokens_field
        raise bad_request(message, param) from None


def check_fields(req: p.BaseModel, refused: dict[str, str]) -> None:
    """ApiError(400) naming the first field of ``req`` that is unknown or not honoured."""
    hit = unhonoured_field(req, refused)
    if hit is not None:
        raise bad_request(hit[1], hit[0])


_DISCONNECTED = object()  # what the disconnect watcher puts in the output queue

# Prompts of at most this many characters (or token ids) are tokenized on the event loop: ~0.3 ms for
# 2,000 characters with SmolLM2's tokenizer, less than the hop to a worker thread and back, which took a
# median ~1.8 ms of a request's TTFT under `vllm bench serve`'s load with the kernels' threads on both
# cores (docs/perf.md "Twenty-second session"). Longer ones go to a thread, so the loop keeps serving
# the other streams meanwhile.
INLINE_PROMPT_CHARS = 2048


async def tokenize_sized(num_chars: int | None, fn, *args):
    """``fn(*args)`` (a tokenization of ``num_chars`` characters or token ids; None: of a size not known
    cheaply) on the event loop when it is short (:data:`INLINE_PROMPT_CHARS`), else in a worker thread;
    its result, or its exception."""
    if num_chars is not None and num_chars <= INLINE_PROMPT_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def message_chars(messages: list[dict[str, str]]) -> int:
    """Characters of a conversation's roles and contents (``chat_messages``' form)."""
    return sum(len(m["content"]) + len(m["role"]) for m in messages)


async def _watch_disconnect(request: Request, q: asyncio.Queue) -> None:
    """Put ``_DISCONNECTED`` into ``q`` when the client has gone (the body is already read, so
    ``receive`` waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    q.put_nowait(_DISCONNECTED)


async def until_disconnected(streams: list[OutputStream], request: Request, constraint: str | None = None,
                             narrowing: tuple[str, ...] = ()) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) of every stream as outputs arrive (one stream per prompt), while the
    client is connected; every unfinished request is aborted when the client leaves or the consumer
    stops early (after vLLM's ``merge_async_iterators`` and ``iterate_with_cancellation``).

    Each stream signals its index into one queue (``OutputStream.listen``), as does the disconnect
    watcher, so each output costs one ``await`` here and wakes nothing else: this runs once per token of
    every stream, on the cores the model's threads need.

    Raises:
        BaseException: the one that ended a stream (the others are aborted).
        ApiError: 400 naming ``constraint`` (the request field of the output constraint) when a
            completion ended with ``"error"``: the constraint admitted no next token (vLLM ends such a
            request the same way and answers 500)."""
    q: asyncio.Queue = asyncio.Queue()
    for i, stream in enumerate(streams):
        stream.listen(functools.partial(q.put_nowait, i))
    watcher = asyncio.ensure_future(_watch_disconnect(request, q))
    try:
        left = len(streams)
        while left:
            entry = await q.get()
            if entry is _DISCONNECTED:
                logger.info("client of %s disconnected", streams[0].request_id)
                return
            stream = streams[entry]
            out = stream.take_nowait()
            if out is None:
                continue
            if stream.finished:
                left -= 1
            dead = next((c for c in out.outputs if c.finish_reason == "error"), None)
            if dead is not None:
                valid = max(0, len(dead.token_ids) - 1)  # the last is the token the constraint rejected
                verb = "narrows" if len(narrowing) == 1 else "narrow"
                why = (f"{' and '.join(narrowing)} also {verb} the tokens it may take" if narrowing
                       else "e.g. a schema whose $ref cycle has no base case")
                raise bad_request(f"{constraint or 'structured output'}: the output constraint admits no "
                                  f"token after the {valid} generated, so no output can satisfy it ({why})",
                                  constraint)
            yield entry, out
    finally:
        for stream in streams:
            stream.abort_if_unfinished()
        # Cancelling (not just dropping) the watcher keeps it alive until it finishes unwinding.
        watcher.cancel()


def sse(model: p.BaseModel | dict) -> str:
    body = model if isinstance(model, p.BaseModel) else p.ErrorResponse(**model)
    body = body.model_dump_json()
    return f"data: {body}\n\n"




def usage_of(outs: list[RequestOutput], generated: bool = True) -> p.UsageInfo:
    completion = sum(len(c.token_ids) for out in outs for c in out.outputs) if generated else 0
    return p.usage_info(sum(len(o.prompt_token_ids) for o in outs), completion,
                        sum(o.num_cached_tokens for o in outs))


MAX_REQUEST_ID_CHARS = 1024  # a client's id is repeated in every streamed chunk


def response_id(prefix: str, raw: Request, request_id: str | None) -> str | None:
    """vLLM 0.32's response ``id``: ``prefix-`` and the ``X-Request-Id`` header if sent, else the body's
    ``request_id``; None when the client gave neither (the first engine request's id is used then).
    Engine requests keep ids of their own, so two requests with one client id do not collide.

    Raises:
        ApiError: 400 for an id longer than :data:`MAX_REQUEST_ID_CHARS` (vLLM sets no limit; the id is
            repeated in every streamed chunk).
    """
    header = raw.headers.get("x-request-id")
    given = header if header is not None else request_id
    if given is not None and len(given) > MAX_REQUEST_ID_CHARS:
        where = "the X-Request-Id header" if header is not None else "request_id"
        raise bad_request(f"{where} has {len(given)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed",
                          "request_id")
    return None if given is None else f"{prefix}-{given}"


def choice_usage(out: RequestOutput, c, generated: bool = True) -> p.UsageInfo:
    """A streamed chunk's ``continuous_usage_stats``: its choice's prompt and the tokens that choice
    ``c`` (a ``CompletionOutput`` of ``out``) has generated so far, as vLLM 0.32 counts them per choice
    (``previous_num_tokens[i]``), not summed over the request's choices and prompts."""
    completion = len(c.token_ids) if generated else 0
    return p.usage_info(len(out.prompt_token_ids), completion, out.num_cached_tokens)


class OpenAIServing:
    """The served model's checks and engine calls, shared by the routes (``serving_completion``,
    ``serving_chat``, ``tokenize``).

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
        self.check_prompt_chars(message_chars(messages), "messages")
        return messages

    def chat_prompt_ids(self, req: p.ChatCompletionRequest, messages: list[dict[str, str]],
                        tools: list[dict] | None = None) -> list[int]:
        from segserve.engine.llm import chat_prompt_ids

        if req.continue_final_message and req.add_generation_prompt:  # vLLM's words
            raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                              "continue_final_message")
        try:
            return chat_prompt_ids(self.llm, messages, req.add_generation_prompt, req.chat_template_kwargs,
                                   tools=tools, continue_final_message=req.continue_final_message,
                                   add_special_tokens=req.add_special_tokens)
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
                     cache_salt: str | None, constraint: str | None = None) -> OutputStream:
        """Add one request; ``constraint``: the request field its output constraint came from
        (:func:`constraint_field`), named in the errors about it."""
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            return await self.engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, params,
                                                 cache_salt=cache_salt)
        except QueueFullError as exc:
            raise ApiError(503, str(exc), type="server_overloaded", code="queue_full") from None
        except EngineDeadError as exc:
            raise engine_error(exc) from None
        except ValueError as exc:
            message = short_error(exc)
            if message.startswith("structured_outputs") and constraint == "response_format":
                # The client sent response_format: name its field, not the engine's.
                message = message.replace("structured_outputs.json", "response_format.json_schema.schema", 1)
                raise bad_request(message, "response_format") from None
            if message.startswith("structured_outputs") and constraint == "tool_choice":
                # The schema is the tools' parameters wrapped by tool_choice: name the tools.
                message = message.replace("structured_outputs.json", "tools (their parameters)", 1)
                raise bad_request(message, "tools") from None
            param = "structured_outputs" if message.startswith("structured_outputs") else _param_of(message)
            raise bad_request(message, param) from None

    async def start_all(self, prompts: list[list[int]], params: SamplingParams, prefix: str,
                         cache_salt: str | None, constraint: str | None = None) -> list[OutputStream]:
        """One engine request per prompt; if one is refused, the ones already added are aborted."""
        streams: list[OutputStream] = []
        try:
            for ids in prompts:
                streams.append(await self._start(ids, params, prefix, cache_salt, constraint))
        except BaseException:
            for stream in streams:
                stream.abort_if_unfinished()
            raise
        return streams


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
class SentSoFar:
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


async def last_each(outputs: AsyncIterator[tuple[int, RequestOutput]], count: int) -> list[RequestOutput]:
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


async def guard_stream(events: AsyncIterator[str], streams: list[OutputStream]) -> AsyncIterator[str]:
    """End a stream cleanly: an engine failure becomes an error event; ``[DONE]`` always closes it;
    the requests are aborted if the events stopped before they finished (their blocks go back at once)."""
    try:
        async for event in events:
            yield event
    except EngineDeadError as exc:
        yield sse_error(engine_error(exc))
    except ApiError as exc:  # the request's own fault, found while it ran
        yield sse_error(exc)
    except Exception as exc:  # noqa: BLE001 - the stream has started: the client gets an error event
        yield sse_error(internal_error(exc))
    finally:
        for stream in streams:
            stream.abort_if_unfinished()
    yield "data: [DONE]\n\n"


NARROWING_FIELDS = ("allowed_token_ids", "bad_words", "logit_bias")


def narrowing_fields(req: p.SamplingFields) -> tuple[str, ...]:
    """The request's fields besides its output constraint that take tokens away (named in the error when
    the constraint is left with none)."""
    return tuple(f for f in NARROWING_FIELDS if getattr(req, f, None))


def constraint_field(req: p.SamplingFields, tool_constraint: bool = False) -> str | None:
    """The request field an output constraint came from (what an error about it names), or None."""
    if tool_constraint:
        return "tool_choice"
    if req.response_format is not None and req.response_format.type != "text":
        return "response_format"
    return "structured_outputs" if req.structured_outputs is not None else None


def sse_error(error: ApiError) -> str:
    info = p.ErrorInfo(message=error.message, type=error.type, param=error.param, code=error.code)
    return sse(p.ErrorResponse(error=info))
