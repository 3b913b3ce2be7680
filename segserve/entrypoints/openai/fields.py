"""Request fields beyond the basic sampling ones (issue 13), kept apart from ``protocol``'s models so
that each group reads on its own.

* ``LogitsFields``: the honoured extras that change the logits or the text (vLLM's names and ranges).
* ``REFUSED_*``: OpenAI and vLLM fields that segserve does not implement, with the reason. The request
  models keep unknown keys (``extra="allow"``) so that ``unhonoured_field`` can answer a 400 naming
  the first one (with its reason when it is a known field), never a silent drop. ``null`` for a
  known refused field means "not used" and passes, as clients send it for unset options. A field that
  another part of the server implements later moves out of these lists.

The README's table lists every field of OpenAI's two request schemas with what happens to it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class LogitsFields(BaseModel):
    """Penalties, bias, token filters and text options; ``SamplingParams`` checks their ranges."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def logits_kwargs(self) -> dict[str, Any]:
        """These fields as ``SamplingParams`` keywords."""
        return {name: getattr(self, name) for name in LogitsFields.model_fields}


# field -> why it is refused (shown in the 400).
REFUSED_COMMON = {
    "guided_json": "vLLM 0.32 has no guided_* fields: use structured_outputs or response_format",
    "guided_regex": "vLLM 0.32 has no guided_* fields: use structured_outputs",
    "guided_choice": "vLLM 0.32 has no guided_* fields: use structured_outputs",
    "guided_grammar": "vLLM 0.32 has no guided_* fields: use structured_outputs",
    "prompt_logprobs": "use echo with logprobs for prompt logprobs",
    "truncate_prompt_tokens": "prompts are never truncated; send a shorter one",
    "use_beam_search": "beam search is not implemented",
    "length_penalty": "beam search is not implemented",
    "priority": "the scheduler has no request priorities",
    "kv_transfer_params": "there is no disaggregated serving",
    "logits_processors": "custom logits processors are not implemented",
    "return_tokens_as_token_ids": "not implemented",
}
REFUSED_COMPLETION = {
    "suffix": "insertion (suffix) is not implemented",
    "prompt_embeds": "prompt embeddings are not implemented",
}
REFUSED_CHAT = {
    "functions": "deprecated by OpenAI: use tools",
    "function_call": "function calling is not implemented",
    "audio": "audio output is not implemented",
    "modalities": "only text output is implemented",
    "prediction": "predicted outputs are not implemented",
    "web_search_options": "web search is not implemented",
    "reasoning_effort": "the model is not a reasoning model",
    "verbosity": "not implemented",
    "chat_template": "only the model's own chat template is used",
    "continue_final_message": "not implemented",
    "echo": "echo is a completions field; chat echo is not implemented",
    "documents": "not implemented",
    "mm_processor_kwargs": "the model takes text only",
}

# Fields of a chat message that segserve does not implement.
REFUSED_MESSAGE = {
    "function_call": "deprecated by OpenAI: use tool_calls",
    "audio": "audio is not implemented",
    "refusal": "not implemented",
    "reasoning_content": "the model is not a reasoning model",
}


def unhonoured_field(body: BaseModel, refused: dict[str, str]) -> tuple[str, str] | None:
    """(field, message) of the first key of ``body`` that segserve does not honour, else None.

    A key is not honoured when it is unknown, or listed in ``refused`` (or, for a request body,
    ``REFUSED_COMMON``) with a non-null value. ``response_format`` of type ``"text"`` is plain text,
    which is what is produced.
    """
    common = REFUSED_COMMON if refused is not REFUSED_MESSAGE else {}
    for name, value in (body.model_extra or {}).items():
        why = refused.get(name) or common.get(name)
        if why is None:
            return name, f"{name} is not a field this server knows (unknown fields are refused, not ignored)"
        if value is None or (name == "response_format" and value == {"type": "text"}):
            continue
        return name, f"{name} is not supported by this server: {why}"
    return None
