"""Structured-output fields of the OpenAI-compatible API: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` extra field, turned into ``StructuredOutputsParams``.

Shapes follow OpenAI's API reference (``{"type": "text" | "json_object" | "json_schema", "json_schema":
{"name", "description", "schema", "strict"}}``) and vLLM 0.32's ``structured_outputs`` (the fields of
``StructuredOutputsParams``). A ``json_schema`` response format is enforced exactly whatever
``strict`` says (the grammar admits only valid instances), as in vLLM.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from segserve.structured_output.params import KINDS, StructuredOutputsParams


class FieldError(ValueError):
    """A request field is invalid; ``param`` names it (answered as 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)

    name: str = "response"
    description: str | None = None
    # ``schema`` shadows a BaseModel attribute, hence the alias (OpenAI's wire name is "schema").
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs`` request field (unknown keys are refused: none is silently dropped)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


def structured_outputs_of(
    response_format: ResponseFormat | None,
    structured: StructuredOutputsField | None,
    tools: StructuredOutputsParams | None = None,
) -> StructuredOutputsParams | None:
    """The constraint a request asks for, or None.

    As in vLLM, ``structured_outputs`` may carry only options (``disable_any_whitespace``) while the
    kind of constraint comes from ``response_format`` or from the tools (``tool_choice`` required or
    named, passed as ``tools``); two sources of a kind are refused.

    Raises:
        FieldError: two kinds asked for, a ``json_schema`` format without a schema, or invalid
            ``structured_outputs`` (the message and ``param`` name the field).
    """
    fields = {} if structured is None else structured.model_dump(by_alias=True, exclude_defaults=True)
    own_kind = [k for k in KINDS if fields.get(k) is not None]
    fmt = None if response_format is None or response_format.type == "text" else response_format
    if fmt is not None and tools is not None:
        raise FieldError("tool_choice required or named constrains the output itself; it cannot be combined "
                         "with response_format", "tool_choice")
    if tools is not None:
        if own_kind:
            raise FieldError(f"tool_choice required or named constrains the output itself; it cannot be "
                             f"combined with structured_outputs.{own_kind[0]}", "tool_choice")
        return dataclasses.replace(tools, **fields)
    if fmt is not None:
        if own_kind:
            raise FieldError(f"set response_format or structured_outputs.{own_kind[0]}, not both",
                             "response_format")
        fields.update(_format_kind(fmt))
    if not fields and structured is None:  # given but empty ({}): refused below, as vLLM refuses it
        return None
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as exc:
        raise FieldError(str(exc), "structured_outputs") from None


def _format_kind(fmt: ResponseFormat) -> dict[str, Any]:
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise FieldError(
            "response_format of type json_schema needs json_schema.schema (a JSON schema)", "response_format"
        )
    return {"json": fmt.json_schema.json_schema}
