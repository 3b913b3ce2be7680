"""``StructuredOutputsParams``: the constraint a request's output must follow (pure Python, no torch).

Named and shaped like vLLM 0.32's ``vllm.sampling_params.StructuredOutputsParams``: exactly one of
``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` is set. The grammar engine
(``segserve.structured_output.grammar``) turns it into a compiled grammar; this module only checks
types and that one kind was chosen, so ``segserve.core`` can carry it without importing xgrammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint.

    Attributes:
        json: a JSON schema (dict, or its JSON text); the output is one JSON value valid against it.
        regex: a regular expression the whole output must match.
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar, in xgrammar's EBNF (GBNF-like, rule ``root``; recognised by
            ``::=``) or in Lark syntax (rule ``start``), as vLLM's xgrammar backend takes them.
        json_object: True: the output is any JSON object (OpenAI's ``response_format: json_object``).
        disable_any_whitespace: JSON kinds only: no whitespace between tokens other than one space
            after ``:`` and ``,`` (vLLM's flag; keeps small models from looping on whitespace).

    Raises:
        ValueError: none or several kinds set, or a field of the wrong type (naming it).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        chosen = [k for k in KINDS if getattr(self, k) is not None]
        if len(chosen) != 1:
            what = "none" if not chosen else f"{len(chosen)} ({', '.join(chosen)})"
            raise ValueError(f"structured_outputs: exactly one of {', '.join(KINDS)} must be set, got {what}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema (dict or str), got {type(self.json).__name__}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(
                    f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}"
                )
            bad = [c for c in self.choice if not isinstance(c, str) or not c]
            if bad:
                raise ValueError(
                    f"structured_outputs.choice entries must be non-empty strings, got {bad[0]!r}"
                )
            object.__setattr__(self, "choice", list(self.choice))
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(
                f"structured_outputs.json_object must be true when given, got {self.json_object!r}"
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                "structured_outputs.disable_any_whitespace must be a bool, got "
                f"{self.disable_any_whitespace!r}"
            )

    @property
    def kind(self) -> str:
        """Which constraint: one of ``KINDS``."""
        return next(k for k in KINDS if getattr(self, k) is not None)

    def cache_key(self) -> tuple[str, str, bool]:
        """(kind, canonical text, whitespace flag): equal keys compile to the same grammar.

        A schema given as a dict or as JSON text has one key; key order is kept (it is the order in
        which the grammar emits an object's properties). Raises ValueError for ``json`` text that is
        not JSON.
        """
        kind = self.kind
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            text = json.dumps(schema)
        elif kind == "choice":
            text = json.dumps(self.choice)
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(self, kind)
        return kind, text, self.disable_any_whitespace
