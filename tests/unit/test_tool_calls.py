"""Tool-call planning and parsing without a model: the constraint each ``tool_choice`` implies, the
hermes parser, and the streamed deltas (a partial ``<tool_call>`` tag is never sent as content)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from segserve.entrypoints.openai.structured import FieldError
from segserve.entrypoints.openai.tool_calls import (
    ChatTool,
    NamedToolChoice,
    ToolStream,
    hermes_parse,
    parse_tool_calls,
    plan_tools,
)

ADD = ChatTool.model_validate({"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}})
NOW = ChatTool.model_validate({"type": "function", "function": {"name": "now"}})


def test_plans_follow_tool_choice():
    assert plan_tools(None, None, None, None).mode == "none"
    named = plan_tools([ADD, NOW], NamedToolChoice.model_validate({"function": {"name": "add"}}), None, None)
    assert (named.mode, named.function, named.constraint.json) == ("named", "add", ADD.function.parameters)
    required = plan_tools([ADD, NOW], "required", False, None)
    schema = required.constraint.json
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
    assert [alt["properties"]["name"]["enum"] for alt in schema["items"]["anyOf"]] == [["add"], ["now"]]
    assert "maxItems" not in plan_tools([ADD], "required", True, None).constraint.json
    auto = plan_tools([ADD], None, None, "hermes")  # tools given, no tool_choice: auto
    assert (auto.mode, auto.constraint, auto.tools[0]["function"]["name"]) == ("auto", None, "add")
    with pytest.raises(FieldError, match="requires --enable-auto-tool-choice"):
        plan_tools([ADD], "auto", None, None)


def test_an_empty_tools_array_is_refused_as_vllm_refuses_it():
    """Regression (a new user's trial, 2026-12-05): ``tools: []`` was taken as no tools (vLLM 0.32 and
    OpenAI answer 400)."""
    for choice in (None, "none", "auto"):
        with pytest.raises(FieldError, match=r"`tools` must not be an empty array") as info:
            plan_tools([], choice, None, "hermes")
        assert info.value.param == "tools"


def test_required_lifts_each_tools_defs_to_the_top_as_vllm_does():
    """A new user's trial (2026-12-05): parameters with `$defs` (pydantic's nested models) gave a 400
    under tool_choice required: `#/$defs/Item` pointed into the wrapping array schema."""
    item = {"type": "object", "properties": {"qty": {"type": "integer"}}, "required": ["qty"]}
    nested = ChatTool.model_validate({"type": "function", "function": {"name": "add", "parameters": {
        "$defs": {"Item": item}, "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}}}})
    schema = plan_tools([nested, NOW], "required", True, None).constraint.json
    assert schema["$defs"] == {"Item": item}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert nested.function.parameters["$defs"] == {"Item": item}  # the request's own tool is untouched
    calls = [{"name": "add", "parameters": {"item": {"qty": 2}}}]
    jsonschema.validate(calls, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "parameters": {"item": {"qty": "two"}}}], schema)
    other = ChatTool.model_validate({"type": "function", "function": {"name": "sub", "parameters": {
        "$defs": {"Item": {"type": "string"}}, "type": "object"}}})
    with pytest.raises(FieldError, match="tools define `\\$defs` 'Item' differently") as info:
        plan_tools([nested, other], "required", True, None)
    assert info.value.param == "tools"


def test_hermes_parse():
    text = 'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><tool_call>{"name": "now"}'
    assert hermes_parse(text) == ("Sure.", [("add", '{"a": 1}'), ("now", "{}")])
    assert hermes_parse("no calls") == ("no calls", [])
    broken = "<tool_call>{not json}</tool_call>"
    assert hermes_parse(broken) == (broken, [])


def test_required_output_parses_into_calls():
    plan = plan_tools([ADD, NOW], "required", True, None)
    content, calls = parse_tool_calls(plan, '[{"name": "add", "parameters": {"a": 2}}, {"name": "now", '
                                            '"parameters": {}}]')
    assert content is None and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("add", {"a": 2}), ("now", {})]
    assert parse_tool_calls(plan, '[{"name": "ad') == ('[{"name": "ad', [])  # cut short: content


def test_auto_stream_holds_back_a_partial_tag_and_sends_calls_at_the_end():
    plan = plan_tools([ADD], "auto", None, "hermes")
    stream = ToolStream(plan)
    full = 'Hi <tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call>'
    sent = [stream.update(full[:k]) for k in (2, 5, 9, 20)]
    assert [c for c, _ in sent] == ["Hi", " ", None, None]  # "<too" is held back, then the tag
    content, deltas = stream.finish(full)
    assert content is None
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [(0, "add", '{"a": 3}')]
    plain = ToolStream(plan)
    assert plain.update("a <to") == ("a ", []) and plain.finish("a <tx") == ("<tx", [])


def test_named_stream_opens_the_call_then_streams_arguments():
    stream = ToolStream(plan_tools([ADD], NamedToolChoice.model_validate({"function": {"name": "add"}}),
                                   None, None))
    _, first = stream.update('{"a"')
    assert first[0].id.startswith("chatcmpl-tool-") and first[0].function.name == "add"
    assert first[0].function.arguments == "" and first[1].function.arguments == '{"a"'
    assert [d.function.arguments for d in stream.finish('{"a": 1}')[1]] == [": 1}"]
