"""Structured output: grammar-constrained decoding on xgrammar (JSON schema, JSON object, regex, choice,
EBNF/Lark grammars).

``params`` is pure Python (``segserve.core`` carries it); ``grammar`` and ``manager`` import xgrammar
and are loaded only by an engine that meets a constrained request.
"""

from segserve.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
