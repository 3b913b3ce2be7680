"""The typing rules every request body of the server follows (OpenAI's and vLLM 0.32's, made strict).

* ``null`` means the default. A field whose type has no ``null`` (``n``, ``stream``, ``echo``,
  ``presence_penalty``, ...) takes its default when a client sends ``null``, as OpenAI and vLLM do. A
  field whose type has ``null`` keeps it with its documented meaning (``max_tokens: null``: up to
  ``max_model_len``, as in vLLM).
* Booleans are not numbers and numbers are not booleans: pydantic's strict mode, so ``true`` is not
  1, ``1`` is not ``true``, ``[[false]]`` is not a token-id prompt and ``1.0`` is not an int.
* Numbers are finite (``1e400`` parses to infinity and is refused).

Ranges that ``SamplingParams`` checks stay there (one message per rule for offline and online use);
this module adds the limits only the server applies (OpenAI's ``temperature`` in [0, 2], which vLLM's
``SamplingParams`` also enforces; seeds within 64 bits as vLLM's protocol bounds them) and the rules
between fields (``stream_options`` only with ``stream``).
"""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

from segserve.entrypoints.openai.limits import quote

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TEMPERATURE = 2.0


class StrictRequest(BaseModel):
    """Base of every request model: strict types, finite numbers, and ``null`` for a non-nullable
    optional field replaced by the field's default. What happens to unknown keys is left to the
    models (pydantic's default ignores them; a model may set ``extra`` itself): the null rule only
    touches declared fields."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if not (v is None and k in fields and _has_default(fields[k]))}

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        # The OpenAPI document tells the truth: a field whose null means its default accepts null.
        schema = handler(core_schema)
        target = handler.resolve_ref_schema(schema)
        for name, prop in target.get("properties", {}).items():
            if name in cls.model_fields and _has_default(cls.model_fields[name]) and "anyOf" not in prop:
                keep = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
                target["properties"][name] = {"anyOf": [dict(prop), {"type": "null"}], **keep}
        return schema


def _has_default(field) -> bool:
    """True for an optional field whose type has no ``null``."""
    return not field.is_required() and not _allows_none(field.annotation)


def _allows_none(annotation: Any) -> bool:
    return annotation is None or annotation is type(None) or type(None) in get_args(annotation)


class StrictSampling(StrictRequest):
    """Cross-field rules and server-only limits of the sampling fields (mixed into the request models)."""

    @field_validator("temperature", check_fields=False)
    @classmethod
    def _temperature_in_range(cls, v: float | None) -> float | None:
        if v is not None and not 0 <= v <= MAX_TEMPERATURE:  # one message for both ends
            shown = repr(v).removesuffix(".0")  # the value as sent (3 for 3.0), never rounded
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {shown}")
        return v

    @field_validator("seed", check_fields=False)
    @classmethod
    def _seed_in_64_bits(cls, v: int | None) -> int | None:
        if v is not None and not INT64_MIN <= v <= INT64_MAX:
            raise ValueError(f"seed must be in [-2^63, 2^63 - 1], got {quote(v)}")
        return v

    @field_validator("stream_options", check_fields=False)
    @classmethod
    def _stream_options_need_stream(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and not info.data.get("stream", False):
            raise ValueError("stream_options can only be set when stream is true")
        return v
