"""Structured output with real clients against the server on SmolLM2-135M-Instruct (slow: real model):
langchain-openai's ``with_structured_output`` (json_schema and function_calling) and the openai
client's ``chat.completions.parse`` return valid instances; the output is greedy, so exact values
are asserted."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from tests.server.checks import openai_client
from tests.server.harness import SERVED_NAME

pytestmark = pytest.mark.slow

QUESTION = "Alice is 31 years old. Extract the person."


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(description="the person's first name")
    age: int = Field(description="age in years")


def test_openai_parse_returns_a_parsed_object(smol_server_and_offline):
    handle, _ = smol_server_and_offline
    out = openai_client(handle).chat.completions.parse(
        model=SERVED_NAME, messages=[{"role": "user", "content": QUESTION}], response_format=Person,
        temperature=0, max_tokens=60,
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.parsed == Person(name="Alice", age=31)
    handle.assert_idle_and_clean()


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(smol_server_and_offline, method):
    from langchain_openai import ChatOpenAI

    handle, _ = smol_server_and_offline
    llm = ChatOpenAI(base_url=f"{handle.base_url}/v1", api_key="unused", model=SERVED_NAME, temperature=0,
                     max_tokens=60, max_retries=0)
    out = llm.with_structured_output(Person, method=method, include_raw=True).invoke(QUESTION)
    assert out["parsing_error"] is None and out["parsed"] == Person(name="Alice", age=31)
    raw = out["raw"]
    if method == "function_calling":  # a named tool_choice: a tool call, finish "stop" (OpenAI's, vLLM's)
        assert raw.response_metadata["finish_reason"] == "stop"
        assert [c["name"] for c in raw.tool_calls] == ["Person"]
    else:
        assert raw.response_metadata["finish_reason"] == "stop" and raw.tool_calls == []
    handle.assert_idle_and_clean()
