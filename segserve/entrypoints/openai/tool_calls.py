"""Tool calling on ``/v1/chat/completions``: OpenAI's ``tools`` / ``tool_choice`` /
``parallel_tool_calls``, the output constraint each choice implies, and parsing the output into
OpenAI's ``tool_calls`` (whole, or as streamed deltas).

Semantics follow vLLM 0.32's serving layer:

- ``tool_choice`` defaults to ``"auto"`` when tools are given, else ``"none"``; any other choice
  without ``tools`` is refused.
- ``"none"``: tools are shown to the chat template, the output is plain content.
- ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}`` objects,
  one alternative per tool (at most one element when ``parallel_tool_calls`` is false); works with
  any model.
- a named function: the output is constrained to that function's ``parameters`` schema and becomes
  the call's ``arguments``.
- ``"auto"``: needs ``--enable-auto-tool-choice`` and ``--tool-call-parser``; the only parser is
  ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, text before the first tag is
  content); with ``parallel_tool_calls`` false only the first call is kept.

A response that carries tool calls has ``finish_reason`` ``"tool_calls"`` (``"length"`` when cut).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from segserve.entrypoints.openai.structured import FieldError
from segserve.structured_output.params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes",)
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # strict.py's typing rules

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


def tool_call_id() -> str:
    """A fresh call id (vLLM's ``chatcmpl-tool-<hex>`` form)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for generation and for its response.

    Attributes:
        mode: ``"none"``, ``"auto"``, ``"required"`` or ``"named"``.
        constraint: the output constraint (``required`` and ``named``), else None.
        function: the forced function's name (``named``).
        parallel: ``parallel_tool_calls``.
        tools: the tools as plain dicts, for the chat template (None without tools).
    """

    mode: str
    constraint: StructuredOutputsParams | None = None
    function: str | None = None
    parallel: bool = True
    tools: list[dict[str, Any]] | None = None


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def plan_tools(
    tools: list[ChatTool] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    parser: str | None,
) -> ToolPlan:
    """Resolve a request's tool fields.

    Args:
        parser: the server's ``--tool-call-parser`` when ``--enable-auto-tool-choice`` is on, else None.

    Raises:
        FieldError: ``tools`` empty; ``tool_choice`` without tools, naming an unknown function, ``auto``
            without a parser; a tool whose ``parameters`` is not a valid JSON schema; duplicate names.
    """
    parallel = parallel_tool_calls is not False
    if tools is not None and not tools:  # as vLLM 0.32 and OpenAI
        raise FieldError("`tools` must not be an empty array: give at least one tool or omit the field",
                         "tools")
    if not tools:
        if tool_choice not in (None, "none"):
            raise FieldError("tool_choice needs tools: set `tools` when using `tool_choice`", "tool_choice")
        return ToolPlan("none", parallel=parallel)
    _check_tools(tools)
    dicts = template_tools(tools)
    choice = tool_choice if tool_choice is not None else "auto"
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in tools]
        if choice.function.name not in names:
            raise FieldError(
                f"tool_choice names function {choice.function.name!r}, which is not in tools {names}",
                "tool_choice",
            )
        tool = tools[names.index(choice.function.name)]
        return ToolPlan(
            "named", StructuredOutputsParams(json=_parameters(tool)), tool.function.name, parallel, dicts
        )
    if choice == "required":
        return ToolPlan(
            "required", StructuredOutputsParams(json=required_schema(tools, parallel)), None, parallel, dicts
        )
    if choice == "auto" and parser is None:
        raise FieldError(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
            "be set on the server",
            "tool_choice",
        )
    return ToolPlan(choice, parallel=parallel, tools=dicts)


def template_tools(tools: list[ChatTool]) -> list[dict[str, Any]]:
    """The tools as the chat template reads them (plain dicts, unset fields left out): one form for
    every route that renders a chat (``/v1/chat/completions``, ``/tokenize``)."""
    return [t.model_dump(exclude_none=True) for t in tools]


def _check_tools(tools: list[ChatTool]) -> None:
    from segserve.structured_output.grammar import build_grammar

    seen = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not name or name in seen:
            raise FieldError(f"tools[{i}].function.name {name!r} is empty or used twice", "tools")
        seen.add(name)
        try:  # conversion only (fast); compilation happens for the constrained modes alone
            build_grammar(StructuredOutputsParams(json=_parameters(tool)))
        except ValueError as exc:
            message = str(exc).replace("structured_outputs.json", f"tools[{i}].function.parameters")
            raise FieldError(message, "tools") from None


def required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """JSON schema of a ``required`` output: ``[{"name": <tool>, "parameters": {...}}, ...]``.

    Each tool's ``$defs`` move to the top of this schema, where its ``#/$defs/...`` references now point
    (pydantic's and LangChain's nested models give such parameters), as vLLM 0.32 does.

    Raises:
        FieldError: a tool's ``$defs`` is not an object, or two tools define one name differently.
    """
    defs: dict[str, Any] = {}
    items = []
    for t in tools:
        params = dict(_parameters(t))
        own = params.pop("$defs", {})
        if not isinstance(own, dict):
            raise FieldError(f"`$defs` in the parameters of tool {t.function.name!r} must be an object, got "
                             f"{type(own).__name__}", "tools")
        for name, schema in own.items():
            if defs.setdefault(name, schema) != schema:
                raise FieldError(f"tools define `$defs` {name!r} differently; tool_choice required needs one "
                                 f"schema per name", "tools")
        items.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": params},
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if defs:
        schema["$defs"] = defs
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished output. Text that does not parse stays content."""
    if plan.mode == "named":
        return None, [ToolCall(id=tool_call_id(), function=FunctionCall(name=plan.function, arguments=text))]
    if plan.mode == "required":
        try:
            calls = json.loads(text)
            found = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
        except (ValueError, TypeError, KeyError):
            return text, []
        return None, [
            ToolCall(id=tool_call_id(), function=FunctionCall(name=n, arguments=a)) for n, a in found
        ]
    if plan.mode == "auto":
        content, found = hermes_parse(text)
        if not plan.parallel:
            found = found[:1]
        return content, [
            ToolCall(id=tool_call_id(), function=FunctionCall(name=n, arguments=a)) for n, a in found
        ]
    return text, []


def hermes_parse(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(content before the first ``<tool_call>``, [(name, arguments JSON)]) of hermes-format text.

    When any call is malformed (not JSON, no ``name``) nothing is a call and all text is content.
    """
    start = text.find(HERMES_START)
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES_CALL.findall(text[start:]):
        try:
            call = json.loads(body)
            calls.append((str(call["name"]), json.dumps(call.get("arguments", {}), ensure_ascii=False)))
        except (ValueError, TypeError, KeyError):
            return text, []
    content = text[:start].strip()
    return content or None, calls


def message_dicts(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat messages as the chat template wants them: ``tool_calls`` arguments as dicts (Hugging Face
    templates index them), ``tool_call_id`` / ``name`` kept for ``role: "tool"`` messages."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            d["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(m, key, None) is not None:
                d[key] = getattr(m, key)
        out.append(d)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            function["arguments"] = json.loads(args)
        except ValueError:
            pass
    return {**call, "function": function}


class ToolStream:
    """Turns one choice's growing text into content and ``tool_calls`` deltas (OpenAI's stream shape).

    ``named``: the call (id, name) opens at once and the text streams as ``arguments``. ``auto``:
    text streams as content up to a ``<tool_call>`` tag (a possible partial tag is held back); the
    calls are sent whole when the output ends. ``required``: the calls are sent whole at the end.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.sent = 0  # characters of text already sent (as content or arguments)
        self.opened = False
        self.calls: list[ToolCall] = []

    def update(self, text: str) -> tuple[str | None, list[DeltaToolCall]]:
        """(content delta, tool-call deltas) for the text so far (not finished)."""
        mode = self.plan.mode
        if mode == "named":
            deltas = []
            if not self.opened:
                self.opened = True
                self.calls = [
                    ToolCall(id=tool_call_id(), function=FunctionCall(name=self.plan.function, arguments=""))
                ]
                deltas.append(
                    DeltaToolCall(
                        index=0,
                        id=self.calls[0].id,
                        type="function",
                        function=DeltaFunctionCall(name=self.plan.function, arguments=""),
                    )
                )
            piece, self.sent = text[self.sent :], len(text)
            if piece:
                deltas.append(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=piece)))
            return None, deltas
        if mode == "auto":
            return self._content(text, _safe_end(text)), []
        if mode == "required":
            return None, []
        return self._content(text, len(text)), []

    def finish(self, text: str) -> tuple[str | None, list[DeltaToolCall]]:
        """Deltas for the end of the output: the rest of the content and the whole calls."""
        if self.plan.mode == "named":
            return self.update(text)
        if self.plan.mode not in ("auto", "required"):
            return self._content(text, len(text)), []
        content, calls = parse_tool_calls(self.plan, text)
        self.calls = calls
        if not calls:
            return self._content(text, len(text)), []
        rest = None
        if content is not None and self.plan.mode == "auto":
            rest = self._content(text, text.find(HERMES_START))
        deltas = [
            DeltaToolCall(
                index=i,
                id=c.id,
                type="function",
                function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments),
            )
            for i, c in enumerate(calls)
        ]
        return rest, deltas

    def _content(self, text: str, end: int) -> str | None:
        piece = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece or None


def _safe_end(text: str) -> int:
    """How much of ``text`` is surely content: up to a ``<tool_call>`` tag or a trailing partial one."""
    start = text.find(HERMES_START)
    if start >= 0:
        return start
    for k in range(min(len(HERMES_START) - 1, len(text)), 0, -1):
        if HERMES_START.startswith(text[-k:]):
            return len(text) - k
    return len(text)
