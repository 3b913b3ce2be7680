"""Every row of the README's request-field table, sent to the server: an honoured field gets a 200, a
refused one (or one the endpoint does not have) a 400 naming it; the server keeps serving."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.server.harness import SERVED_NAME

README = Path(__file__).resolve().parents[2] / "README.md"
ROW = re.compile(r"^\| (`[^|]+`) \| (honoured|refused|—) \| (honoured|refused|—) \|")
BASE = {
    "completions": {"model": SERVED_NAME, "prompt": "The quick brown fox", "max_tokens": 2},
    "chat": {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# A value each field may take (valid where the field is honoured); a dict adds fields it needs.
SAMPLES = {
    "model": SERVED_NAME, "prompt": ["a b", "c d"], "messages": [{"role": "user", "content": "yo"}],
    "best_of": 1, "frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {"5": 2.0},
    "max_tokens": 3, "max_completion_tokens": 3, "n": 2, "seed": 3, "stop": ["zz"],
    "stream": True, "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "temperature": 0.5, "top_p": 0.9, "user": "u1", "safety_identifier": "s", "prompt_cache_key": "k",
    "metadata": {"k": "v"}, "service_tier": "auto", "store": False, "suffix": " end",
    "response_format": {"type": "json_object"}, "tools": {"tools": [TOOL], "tool_choice": "none"},
    "tool_choice": {"tools": [TOOL], "tool_choice": "required"},
    "parallel_tool_calls": True, "functions": [TOOL["function"]], "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "web_search_options": {},
    "reasoning_effort": "low", "verbosity": "low", "top_k": 5, "min_p": 0.1, "min_tokens": 1,
    "ignore_eos": True, "stop_token_ids": [7], "repetition_penalty": 1.2, "allowed_token_ids": [40, 41],
    "bad_words": ["fox"], "include_stop_str_in_output": True, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "add_generation_prompt": False,
    "chat_template_kwargs": {"unused_flag": True}, "guided_json": {"type": "object"}, "guided_regex": "a+",
    "guided_choice": ["a"], "guided_grammar": "root ::= 'a'", "structured_outputs": {"regex": "a"},
    "prompt_logprobs": 1, "use_beam_search": True, "length_penalty": 0.5, "truncate_prompt_tokens": 4,
    "priority": 1, "logits_processors": ["x"], "return_tokens_as_token_ids": True,
    "kv_transfer_params": {}, "prompt_embeds": "AAAA", "chat_template": "{{ messages }}",
    "continue_final_message": True, "documents": [{"text": "x"}], "mm_processor_kwargs": {},
    "cache_salt": "tenant-a", "request_id": "client-7", "add_special_tokens": True,
}
PER_ENDPOINT = {("completions", "logprobs"): 2, ("chat", "logprobs"): True,
                ("completions", "echo"): True, ("chat", "echo"): True,
                ("chat", "top_logprobs"): {"logprobs": True, "top_logprobs": 2},
                ("completions", "top_logprobs"): 2,
                ("completions", "tools"): [TOOL], ("completions", "tool_choice"): "auto",
                ("chat", "continue_final_message"): {  # vLLM refuses it with add_generation_prompt (default)
                    "continue_final_message": True, "add_generation_prompt": False,
                    "messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "Sure"}]}}


def _rows() -> list[tuple[str, str, str]]:
    """(field, endpoint, "honoured" / "refused" / "—") for every field named in the README table."""
    rows = []
    for line in README.read_text().splitlines():
        m = ROW.match(line)
        if m:
            for name in re.findall(r"`([a-z_]+)`", m.group(1)):
                rows += [(name, "completions", m.group(2)), (name, "chat", m.group(3))]
    return rows


ROWS = _rows()
OPENAI_FIELDS = {
    "completions": "model prompt best_of echo frequency_penalty logit_bias logprobs max_tokens n "
                   "presence_penalty seed stop stream stream_options suffix temperature top_p user".split(),
    "chat": "messages model audio frequency_penalty function_call functions logit_bias logprobs "
            "max_completion_tokens max_tokens metadata modalities n parallel_tool_calls prediction "
            "presence_penalty prompt_cache_key reasoning_effort response_format safety_identifier seed "
            "service_tier stop store stream stream_options temperature tool_choice tools top_logprobs "
            "top_p user verbosity web_search_options".split(),
}


def test_the_table_covers_every_openai_request_field():
    listed = {(f, e) for f, e, status in ROWS if status != "—"}
    for endpoint, fields in OPENAI_FIELDS.items():
        missing = [f for f in fields if (f, endpoint) not in listed]
        assert not missing, f"README table lacks {endpoint} fields {missing}"


def _body(field: str, endpoint: str) -> dict:
    key = (endpoint, field)
    sample = PER_ENDPOINT[key] if key in PER_ENDPOINT else SAMPLES[field]
    extra = sample if isinstance(sample, dict) and field in sample else {field: sample}
    return {**BASE[endpoint], **extra}


@pytest.mark.parametrize("field,endpoint,status", ROWS, ids=[f"{e}-{f}" for f, e, _ in ROWS])
def test_each_field_is_honoured_or_refused_by_name(tiny_server, field, endpoint, status):
    handle, _ = tiny_server
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    r = httpx.post(handle.base_url + path, json=_body(field, endpoint), timeout=60)
    if status == "honoured":
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field, r.text
        assert field in r.json()["error"]["message"]
    handle.assert_idle_and_clean()
