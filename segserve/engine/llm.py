"""``LLM``: the offline API (vLLM-shaped) over an ``LLMEngine``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from segserve.engine.llm_engine import LLMEngine, PromptType
from segserve.outputs import RequestOutput
from segserve.sampling_params import SamplingParams

ChatMessages = list[dict[str, str]]


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
            ``attention_cost_tokens``, ``seed``).
    """

    def __init__(self, model: Any = None, **engine_kwargs: Any) -> None:
        self.llm_engine = LLMEngine(model=model, **engine_kwargs)

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
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: ChatMessages, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template."""
        return chat_prompt_ids(self.llm_engine, messages, add_generation_prompt)

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


def chat_prompt_ids(
    engine: LLMEngine,
    messages: ChatMessages,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Render a conversation with the tokenizer's chat template and tokenize it (no extra BOS).

    ``template_kwargs`` are extra variables for the template (vLLM's ``chat_template_kwargs``).
    """
    tokenizer = engine.tokenizer
    template = engine.loaded.chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(f"model {engine.loaded.name} has no chat template; pass plain prompts instead")
    text = tokenizer.apply_chat_template(
        messages,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **(template_kwargs or {}),
    )
    return tokenizer.encode(text, add_special_tokens=False)


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    if not prompts:
        raise ValueError("no prompts given")
    return prompts
