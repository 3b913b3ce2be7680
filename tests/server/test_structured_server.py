"""Structured output and tool calls through the server on the tiny model, with the official client:
``response_format`` (json_schema, json_object), vLLM's ``structured_outputs`` (regex, choice,
grammar), ``tools`` with every ``tool_choice`` (named and required constrain the output; auto parses
hermes ``<tool_call>`` tags), streamed deltas equal to whole responses, and every bad input is a 400
naming its field while the engine keeps serving."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from tests.server.checks import openai_client
from tests.server.conftest import TINY_ENGINE
from tests.server.harness import SERVED_NAME, running_server

MSGS = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer",
                                                                                "minimum": 1, "maximum": 9}},
            "required": ["city", "days"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
NO_WS = {"structured_outputs": {"disable_any_whitespace": True}}


@pytest.fixture(scope="module")
def server(tiny_loaded):
    from segserve import LLMEngine

    with running_server(LLMEngine(tiny_loaded, **TINY_ENGINE), tool_parser="hermes") as (handle, _):
        yield handle


def chat(handle, **kw):
    return openai_client(handle).chat.completions.create(model=SERVED_NAME, messages=MSGS, **kw)


def streamed(handle, **kw) -> tuple[dict, str | None, str]:
    """(tool calls by index {id, name, arguments}, finish_reason, content) of a streamed chat."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in chat(handle, stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return calls, finish, content


def test_response_format_json_schema_validates(server):
    schema = WEATHER["function"]["parameters"]
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}
    outs = [chat(server, response_format=rf, max_tokens=60, temperature=1.0, seed=s, extra_body=NO_WS)
            for s in range(6)]
    done = [json.loads(o.choices[0].message.content) for o in outs if o.choices[0].finish_reason == "stop"]
    assert len(done) >= 3
    for value in done:
        jsonschema.validate(value, schema)
    server.assert_idle_and_clean()


def test_response_format_json_object_and_length_mid_object(server):
    out = chat(server, response_format={"type": "json_object"}, max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.content.startswith("{")
    assert out.usage.completion_tokens == 3


@pytest.mark.parametrize("so, check", [
    ({"regex": r"[a-c]{2}\d"}, lambda t: re.fullmatch(r"[a-c]{2}\d", t)),
    ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"grammar": 'root ::= "x" ("+" "x")*'}, lambda t: re.fullmatch(r"x(\+x)*", t)),
])
def test_structured_outputs_field_constrains_chat_and_completions(server, so, check):
    client = openai_client(server)
    for seed in range(4):
        c = chat(server, extra_body={"structured_outputs": so}, max_tokens=30, temperature=1.0, seed=seed)
        assert check(c.choices[0].message.content), c.choices[0].message.content
        t = client.completions.create(model=SERVED_NAME, prompt="fox", max_tokens=30, temperature=1.0,
                                      seed=seed, extra_body={"structured_outputs": so})
        assert check(t.choices[0].text), t.choices[0].text


def test_named_tool_choice_whole_and_streamed(server):
    kw = dict(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}},
              max_tokens=60, temperature=0, extra_body=NO_WS)
    out = chat(server, **kw)
    choice = out.choices[0]
    # "stop" for a named function, as OpenAI and vLLM 0.32 (was "tool_calls": a new user's trial)
    assert choice.finish_reason == "stop" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    calls, finish, content = streamed(server, **kw)
    assert finish == "stop" and content == ""
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == call.function.arguments


def test_streamed_tool_calls_carry_the_logprobs_of_every_token(server):
    """A new user's trial (2026-12-05): streamed chunks of a named (or required) tool choice had
    ``logprobs: null`` while the same request unstreamed had them all."""
    kw = dict(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}},
              max_tokens=30, temperature=0, extra_body=NO_WS, logprobs=True, top_logprobs=2)
    whole = chat(server, **kw)
    want = [(t.token, t.logprob) for t in whole.choices[0].logprobs.content]
    assert len(want) == whole.usage.completion_tokens
    got = []
    client = openai_client(server)
    stream = client.chat.completions.create(model=SERVED_NAME, messages=MSGS, stream=True, **kw)
    for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                got += [(t.token, t.logprob) for t in choice.logprobs.content]
                assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert got == want


def test_required_tool_choice_takes_parameters_with_defs(server):
    """pydantic's nested models give parameters with `$defs` (was a 400 naming structured_outputs)."""
    item = {"type": "object", "properties": {"qty": {"type": "integer"}}, "required": ["qty"]}
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "$defs": {"Item": item}, "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}},
        "required": ["item"]}}}
    out = chat(server, tools=[tool], tool_choice="required", max_tokens=60, temperature=0, extra_body=NO_WS)
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason in ("tool_calls", "length")
    if out.choices[0].finish_reason == "tool_calls":
        args = json.loads(calls[0].function.arguments)
        assert calls[0].function.name == "add" and isinstance(args["item"]["qty"], int)
    server.assert_idle_and_clean()


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_calls_listed_tools(server, parallel):
    # Sampled: greedy on the random model keeps adding calls until max_tokens; some seed ends the list.
    for seed in range(12):
        kw = dict(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=parallel, max_tokens=100,
                  temperature=1.0, seed=seed, extra_body=NO_WS)
        out = chat(server, **kw)
        if out.choices[0].finish_reason != "length":
            break
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and calls
    assert len(calls) == 1 or parallel
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    got, finish, _ = streamed(server, **kw)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in got.values()] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


# A short call: the tiny model's context is 128 tokens.
TINY_TOOL = {"type": "function", "function": {"name": "t"}}
HERMES = '<tool_call>{"name":"t","arguments":{}}</tool_call>'


def test_auto_tool_choice_parses_hermes_tool_calls(server):
    # The tiny model never writes tags by itself: a regex makes it write exactly this output.
    # (Up to one token per character: 102 tokens.)
    forced = {"structured_outputs": {"regex": re.escape("k " + HERMES + HERMES)}}
    kw = dict(tools=[WEATHER, TINY_TOOL], max_tokens=108, temperature=0, extra_body=forced)
    out = chat(server, **kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "k"
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("t", {})] * 2
    calls, finish, content = streamed(server, **kw)
    assert finish == "tool_calls" and content == "k " and len(calls) == 2
    single = chat(server, parallel_tool_calls=False, **kw).choices[0].message.tool_calls
    assert len(single) == 1
    plain = chat(server, tools=[WEATHER], max_tokens=5, temperature=0)  # no tags: plain content
    assert plain.choices[0].message.tool_calls == [] and plain.choices[0].finish_reason == "length"


def test_tool_choice_none_and_tool_messages_are_accepted(server):
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    out = openai_client(server).chat.completions.create(
        model=SERVED_NAME, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=4, temperature=0
    )
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.tool_calls == []


STRICT_YES = {"name": "x", "schema": {}, "strict": "yes"}
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}
CASES = [
    ({"response_format": BAD_SCHEMA}, "response_format", "response_format.json_schema.schema is not a valid"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "needs json_schema.schema"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "structured_outputs.regex is invalid"),
    ({"structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs", "grammar is invalid"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "got 2 (regex, choice)"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs", "jsonn"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "response_format",
     "set response_format or structured_outputs.regex, not both"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs", "got none"),
    ({"structured_outputs": {}}, "structured_outputs", "got none"),  # was no constraint (a trial's finding)
    # strict types in the nested fields too (a trial's finding: "yes" was taken for true)
    ({"response_format": {"type": "json_schema", "json_schema": STRICT_YES}}, "response_format", "strict"),
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs", "json_object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools", "strict"),
    ({"tools": []}, "tools", "`tools` must not be an empty array"),  # was no tools (a trial's finding)
    ({"tools": [WEATHER], "tool_choice": "required", "structured_outputs": {"regex": "a"}}, "tool_choice",
     "combined with structured_outputs.regex"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not in tools ['get_weather']"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]}, "tools",
     "tools[0].function.parameters is not a valid JSON schema"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "used twice"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined"),
]


# A schema xgrammar compiles but no output satisfies: a $ref cycle with no base case.
UNSATISFIABLE = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_no_output_can_satisfy_is_an_error_naming_the_field(server, stream):
    """A new user's trial (2026-12-05): HTTP 200 with empty content and finish_reason "abort" (not an
    OpenAI reason). vLLM ends such a request with its "error" reason and answers 500; here the field is
    named, 400, or an error event in a stream."""
    body = {"model": SERVED_NAME, "messages": MSGS, "max_tokens": 8, "response_format": UNSATISFIABLE,
            "stream": stream}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        error = events[-1]["error"]
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
    assert error["param"] == "response_format" and "admits no token after the 0 generated" in error["message"]
    server.assert_idle_and_clean()


def test_a_constraint_emptied_by_allowed_token_ids_names_that_field_too(server):
    """A new user's trial (session 25): a choice constraint with ``allowed_token_ids`` that exclude every
    choice's tokens was answered with "e.g. a schema whose $ref cycle has no base case", naming only
    ``structured_outputs``; the message now names the request's other token-narrowing fields."""
    body = {"model": SERVED_NAME, "messages": MSGS, "max_tokens": 8, "allowed_token_ids": [1, 2, 3],
            "structured_outputs": {"choice": ["red", "green", "blue"]}}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "structured_outputs"
    assert "allowed_token_ids also narrows the tokens" in error["message"], error
    assert "$ref" not in error["message"]
    server.assert_idle_and_clean()


@pytest.mark.parametrize("extra, param, words", CASES)
def test_bad_input_is_400_naming_the_field(server, extra, param, words):
    body = {"model": SERVED_NAME, "messages": MSGS, "max_tokens": 4, **extra}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    good = chat(server, extra_body={"structured_outputs": {"choice": ["fine"]}}, max_tokens=4)
    assert good.choices[0].message.content == "fine"
    server.assert_idle_and_clean()


def test_auto_without_a_parser_is_refused(tiny_server):
    handle, _ = tiny_server
    body = {"model": SERVED_NAME, "messages": MSGS, "tools": [WEATHER]}
    r = httpx.post(f"{handle.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice and --tool-call-parser" in r.json()["error"]["message"]
