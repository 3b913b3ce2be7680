"""``POST /v1/completions``: prompts (text, token ids, or lists of either) in; choices, or their
server-sent events, out. ``echo`` puts the prompt (and under ``logprobs`` its logprobs, OpenAI's
legacy shape) before the generated text; ``max_tokens: 0`` with ``echo`` returns the prompt alone.
The validation, the engine calls and the stream's end are shared with chat (``serving``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from segserve.entrypoints.openai import protocol as p
from segserve.entrypoints.openai.errors import bad_request
from segserve.entrypoints.openai.fields import REFUSED_COMPLETION
from segserve.entrypoints.openai.logprobs_format import CompletionLogprobsBuilder
from segserve.entrypoints.openai.serving import (
    OpenAIServing,
    SentSoFar,
    check_fields,
    choice_usage,
    constraint_field,
    guard_stream,
    last_each,
    narrowing_fields,
    response_id,
    sampling_params,
    short_error,
    sse,
    tokenize_sized,
    until_disconnected,
    usage_of,
)
from segserve.outputs import RequestOutput


@dataclass
class _Prompt:
    """One prompt of a request: its text (decoded when token ids were sent) and token ids."""

    text: str
    ids: list[int]




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




def prompt_size(prompt) -> int:
    """Characters of a completions ``prompt``'s texts plus its token ids (what tokenizing, or decoding
    the ids for ``echo``, is proportional to)."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(one) if isinstance(one, str | list) else 1 for one in prompt or ())


def completion_prompts(serving: OpenAIServing, req: p.CompletionRequest) -> list[_Prompt]:
    """Every prompt of the request (a string, token ids, or a non-empty list of either), each
    checked for length before it is tokenized (off the event loop when long: ``tokenize_sized``)."""
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    elif not prompt:
        raise bad_request("prompt is empty (0 prompts); at least 1 is needed", "prompt")
    else:
        prompts = list(prompt)
    for one in prompts:
        if isinstance(one, str):
            serving.check_prompt_chars(len(one), "prompt")
        else:
            serving.check_length(len(one), req.max_tokens, "prompt")
    out = []
    for one in prompts:
        try:
            text, ids = serving.llm.tokenize(one, add_special_tokens=req.add_special_tokens)
        except ValueError as exc:
            raise bad_request(short_error(exc), "prompt") from None
        out.append(_Prompt(text if text is not None else serving.llm.tokenizer.decode(ids), ids))
    return out


async def create_completion(serving: OpenAIServing, req: p.CompletionRequest, raw: Request):
    """``POST /v1/completions``: a ``CompletionResponse``, or a ``StreamingResponse`` of its chunks.

    Raises:
        ApiError: a bad field (400, naming it), an unknown model (404), a full queue (503).
    """
    serving.check_model(req.model)
    check_fields(req, REFUSED_COMPLETION)
    if req.best_of not in (None, req.n):
        raise bad_request(f"best_of={req.best_of} is not supported (only best_of == n)", "best_of")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be >= 1 without echo, got 0 (with echo, 0 returns the prompt "
                          "alone, scored under logprobs)", "max_tokens")
    shape = _CompletionShape(req.echo, req.logprobs, req.echo and req.max_tokens == 0, req.n)
    # max_tokens 0 with echo: generate one token and drop it (vLLM 0.32 does the same).
    max_tokens = 1 if shape.echo_only else req.max_tokens
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    serving.check_top_k(req)
    params = sampling_params(req, max_tokens, req.logprobs, prompt_logprobs)
    serving.check_servable(params)
    prompts = await tokenize_sized(prompt_size(req.prompt), completion_prompts, serving, req)
    for prompt in prompts:
        serving.check_length(len(prompt.ids), max_tokens, "prompt")
    field = constraint_field(req)
    salt = serving.salt_of(req, raw)
    given_id = response_id("cmpl", raw, req.request_id)
    streams = await serving.start_all([x.ids for x in prompts], params, "cmpl", salt, field)
    rid, model = given_id or streams[0].request_id, serving.names[0]
    outputs = until_disconnected(streams, raw, field, narrowing_fields(req))
    if req.stream:
        events = _completion_events(serving, outputs, rid, model, shape, prompts, req)
        return StreamingResponse(guard_stream(events, streams), media_type="text/event-stream")
    finals = await last_each(outputs, len(streams))
    choices = [_completion_choice(serving, shape, i, prompts[i], out, c)
               for i, out in enumerate(finals) for c in out.outputs]
    return p.CompletionResponse(id=rid, model=model, choices=choices,
                                usage=usage_of(finals, not shape.echo_only))


def _completion_choice(serving: OpenAIServing, shape: _CompletionShape, i: int, prompt: _Prompt,
                       out: RequestOutput, c) -> p.CompletionChoice:
    text = (prompt.text if shape.echo else "") + ("" if shape.echo_only else c.text)
    logprobs = None
    if shape.logprobs is not None:
        logprobs = CompletionLogprobsBuilder(serving.decode_token).add(*shape.tokens(out, c))
    return p.CompletionChoice(index=shape.index(i, c.index), text=text,
                              logprobs=logprobs, finish_reason=c.finish_reason,
                              stop_reason=c.stop_reason)


async def _completion_events(serving: OpenAIServing, outputs: AsyncIterator[tuple[int, RequestOutput]],
                             rid: str, model: str, shape: _CompletionShape, prompts: list[_Prompt],
                             req: p.CompletionRequest) -> AsyncIterator[str]:
    sent: dict[int, SentSoFar] = {}
    last: dict[int, RequestOutput] = {}
    async for i, out in outputs:
        last[i] = out
        choices = []
        for c in out.outputs:
            key = shape.index(i, c.index)
            state = sent.setdefault(key, SentSoFar(CompletionLogprobsBuilder(serving.decode_token)))
            choice = completion_delta(state, shape, prompts[i], out, c, key)
            if choice is not None:
                choices.append((choice, c))
        for choice, c in choices:  # one choice a chunk, as vLLM streams n > 1
            usage = choice_usage(out, c, not shape.echo_only) if req.continuous_usage else None
            yield sse(p.CompletionResponse(id=rid, model=model, choices=[choice], usage=usage))
    finals = list(last.values())
    if req.include_usage and len(finals) == len(prompts) and all(o.finished for o in finals):
        yield sse(p.CompletionResponse(id=rid, model=model, choices=[],
                                        usage=usage_of(finals, not shape.echo_only)))


def completion_delta(state: SentSoFar, shape: _CompletionShape, prompt: _Prompt, out: RequestOutput, c,
                     index: int) -> p.CompletionChoice | None:
    """The next chunk's choice, or None when there is nothing to send yet. Under ``echo`` the prompt
    goes out with the first generated token, when its logprobs are complete. As in vLLM 0.32, a step
    that generated tokens sends a chunk even when its text is held back (empty ``text``)."""
    done = c.finish_reason is not None
    if state.done or (not done and (shape.echo_only or (shape.echo and not c.token_ids))):
        return None
    text = (prompt.text if shape.echo else "") + ("" if shape.echo_only else c.text)
    ids, pos = shape.tokens(out, c)
    if not done and len(text) <= state.chars and len(ids) <= state.tokens:
        return None
    new_text, ids, pos = state.take(text, ids, pos)
    state.done = done
    logprobs = state.builder.add(ids, pos) if shape.logprobs is not None and state.builder else None
    return p.CompletionChoice(index=index, text=new_text, logprobs=logprobs,
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
