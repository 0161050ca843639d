"""Structured output: grammar-constrained decoding of JSON (``response_format``) and tool calls.

A request's :class:`StructuredOutputParams` (a field of ``SamplingParams``) names a grammar: a
JSON schema, any JSON object, optionally between a literal prefix and suffix (a tool call's
delimiters). The engine's :class:`StructuredOutputs` compiles it once per distinct grammar
against the tokenizer's vocabulary (:mod:`vocabulary`, :mod:`compiler`), keeps one matcher per
request advanced by the request's accepted tokens (:mod:`matcher`), and before each sampling
fills a token bitmask for the constrained rows on the host and applies it to their logits on
the device (:mod:`batch`).

Library: `xgrammar <https://github.com/mlc-ai/xgrammar>`_. It is maintained (the default
structured-output backend of vLLM and SGLang), installs from a wheel without pulling another
torch, compiles JSON schemas and EBNF to a pushdown automaton with a precomputed
context-independent token cache (so a bitmask costs microseconds per row even for large
vocabularies), supports raw-byte and byte-level BPE vocabularies (both of our tokenizers), and has
rollback, which checks speculative drafts without copying matcher state. llguidance has a similar
engine but a thinner Python API around batching and rollback; outlines-core builds a full
token-level DFA per schema, which is slow to compile for nested schemas and large vocabularies.
"""

from megatron.core.inference.structured_output.errors import GrammarCompileError, InvalidStructuredOutputError
from megatron.core.inference.structured_output.params import StructuredOutputParams

__all__ = ["GrammarCompileError", "InvalidStructuredOutputError", "StructuredOutputParams"]
