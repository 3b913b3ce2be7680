"""From ``StructuredOutputsParams`` to an xgrammar ``Grammar`` (fast, checks the input) and from that to a
compiled grammar (slow: the per-token masks of the tokenizer's vocabulary are precomputed).

The split follows vLLM's xgrammar backend: the request is validated when it arrives (a bad schema,
regex or grammar is the client's error, answered at once), and only compilation runs in the
background. Kinds map to xgrammar as vLLM maps them: ``json`` -> JSON schema (strict mode, as
xgrammar's default), ``json_object`` -> the schema ``{"type": "object"}``, ``choice`` -> an EBNF
alternation of string literals, ``regex`` -> xgrammar's regex, ``grammar`` -> EBNF or Lark.
"""

from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr

from segserve.structured_output.params import StructuredOutputsParams

JSON_OBJECT_SCHEMA = '{"type": "object"}'


def build_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The xgrammar ``Grammar`` of ``params``.

    Raises:
        ValueError: the schema is not a valid JSON schema or uses what xgrammar cannot express; the
            regex or grammar does not parse. The message names the field and the library's reason.
    """
    kind, text, no_ws = params.cache_key()
    try:
        if kind == "json":
            schema = json.loads(text)
            _check_json_schema(schema)
            _refuse_unenforced(schema)
            return json_schema_grammar(text, any_whitespace=not no_ws)
        if kind == "json_object":
            return json_schema_grammar(JSON_OBJECT_SCHEMA, any_whitespace=not no_ws)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(params.choice or []))
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if is_ebnf(text):
            return xgr.Grammar.from_ebnf(text)
        return xgr.Grammar.from_lark(text)
    except ValueError:
        raise
    except RecursionError:  # the meta-schema check (or xgrammar's converter) walks nested schemas
        raise ValueError(f"structured_outputs.{kind} nests too deeply to check (schemas inside schemas "
                         f"beyond Python's recursion limit); flatten it, e.g. with $defs") from None
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError and its own types
        raise ValueError(f"structured_outputs.{kind} is invalid or unsupported: {_first_line(exc)}") from None


# xgrammar 0.2.8 writes the characters of a string with minLength/maxLength as this class, which admits
# raw control characters (U+0000-U+001F other than CR/LF): invalid JSON. Its unbounded strings exclude
# them; bounded ones get the same class here (escapes stay out of bounded strings, as before).
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


def json_schema_grammar(schema: str, any_whitespace: bool) -> xgr.Grammar:
    """xgrammar's grammar of a JSON schema (text), with bounded-length strings kept to valid JSON."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace)
    ebnf = str(grammar)
    if _LOOSE_STRING_CHAR not in ebnf:
        return grammar
    return xgr.Grammar.from_ebnf(ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def choice_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b"``: EBNF matching exactly one of ``choices`` (JSON string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def is_ebnf(grammar: str) -> bool:
    """EBNF/GBNF defines rules with ``::=``; Lark with ``:`` (vLLM tells the two apart the same way)."""
    return "::=" in grammar


def _check_json_schema(schema: Any) -> None:
    """ValueError naming the problem when ``schema`` is not a JSON schema (jsonschema's meta-schema)."""
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        message = f"structured_outputs.json is not a valid JSON schema at {where}: {exc.message}"
        raise ValueError(message) from None


# Where a JSON schema holds subschemas (JSON Schema 2020-12): a map of them, one, or a list of them.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "propertyNames", "unevaluatedItems",
               "unevaluatedProperties", "contains", "not", "if", "then", "else")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
# Keywords xgrammar 0.2.8 compiles without enforcing: for each, a string that breaks it matches the
# grammar (checked one by one; multipleOf, patternProperties, propertyNames, dependentSchemas and const
# are enforced). allOf is enforced with one entry (pydantic's wrapper of a $ref) and not with more.
_UNENFORCED = ("not", "if", "then", "else", "contains", "minContains", "maxContains")


def _refuse_unenforced(schema: Any, where: str = "") -> None:
    """ValueError naming the first keyword of ``schema`` (at a schema position, not a property name)
    that the grammar would not enforce, so no output is claimed to follow a schema it may break (vLLM's
    newer releases check the same, fail-closed)."""
    if not isinstance(schema, dict):
        return
    used = next((f"`{key}`" for key in _UNENFORCED if key in schema), None)
    remedy = "remove it or state the constraint another way"
    if used is None and schema.get("uniqueItems") is True:
        used = "`uniqueItems`"
    if used is None and isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        used, remedy = f"`allOf` with {len(schema['allOf'])} schemas", "merge them into one"
    if used is not None:
        raise ValueError(f"structured_outputs.json uses {used} at {where or '(root)'}, which is not enforced "
                         f"by the grammar backend (xgrammar): {remedy}")
    prefix = f"{where}/" if where else ""
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                _refuse_unenforced(sub, f"{prefix}{key}/{name}")
    for key in _SCHEMA_ONE:
        if isinstance(schema.get(key), dict):
            _refuse_unenforced(schema[key], f"{prefix}{key}")
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                _refuse_unenforced(sub, f"{prefix}{key}/{i}")


# xgrammar's C++ errors start with its log prefix, "[18:42:50] /project/cpp/regex_converter.cc:83: ": a
# time and a source line of no use to a client.
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: ")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return _XGRAMMAR_LOG_PREFIX.sub("", text.splitlines()[0])[:300]
