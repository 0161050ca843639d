"""Compiled grammars of one tokenizer's vocabulary, cached per grammar."""

from __future__ import annotations

import re
from collections import OrderedDict

from megatron.core.inference.structured_output.errors import GrammarCompileError
from megatron.core.inference.structured_output.params import StructuredOutputParams
from megatron.core.tokenizers import MegatronTokenizer

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:line: " (and sometimes "Check failed: ... is false: ").
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _reason(error: Exception) -> str:
    return _NATIVE_PREFIX.sub("", str(error).strip()).splitlines()[0]


class GrammarCache:
    """Compiles :class:`StructuredOutputParams` against one vocabulary (its grammars end with
    ``eos_token_id``, the engine's end-of-sequence token); keeps the last
    ``capacity`` distinct grammars (least recently used goes first). The vocabulary is
    prepared on first use, so an engine whose requests never ask for a grammar pays nothing.

    Raises (from :meth:`compile`): :class:`GrammarCompileError` for a grammar that does not
    compile (a bad schema), or when the tokenizer cannot be constrained.
    """

    def __init__(
        self, tokenizer: MegatronTokenizer | None, vocab_size: int, eos_token_id: int | None, capacity: int = 256
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.capacity = capacity
        self._compiler = None
        self._compiled: OrderedDict[StructuredOutputParams, object] = OrderedDict()

    def compile(self, params: StructuredOutputParams):
        """The ``xgrammar.CompiledGrammar`` of ``params`` (cached)."""
        compiled = self._compiled.get(params)
        if compiled is not None:
            self._compiled.move_to_end(params)
            return compiled
        compiled = self._build(params)
        self._compiled[params] = compiled
        if len(self._compiled) > self.capacity:
            self._compiled.popitem(last=False)
        return compiled

    def _build(self, params: StructuredOutputParams):
        try:
            import xgrammar
        except ImportError:
            raise GrammarCompileError(
                grammar=params.describe(), reason="this server lacks xgrammar; install megatron-core[serving]"
            ) from None

        if self._compiler is None:
            from megatron.core.inference.structured_output.vocabulary import tokenizer_info

            self._compiler = xgrammar.GrammarCompiler(
                tokenizer_info(self.tokenizer, self.vocab_size, self.eos_token_id), max_threads=1
            )
        try:
            schema = '{"type":"object"}' if params.json_object else params.json_schema
            value = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=params.strict)
            parts = [xgrammar.Grammar.from_ebnf(f"root ::= {_literal(params.prefix)}")] if params.prefix else []
            parts.append(value)
            if params.suffix:
                parts.append(xgrammar.Grammar.from_ebnf(f"root ::= {_literal(params.suffix)}"))
            grammar = xgrammar.Grammar.concat(*parts) if len(parts) > 1 else value
            return self._compiler.compile_grammar(grammar)
        except RuntimeError as error:  # xgrammar reports every bad grammar as a RuntimeError
            raise GrammarCompileError(grammar=params.describe(), reason=_reason(error)) from None


def _literal(text: str) -> str:
    """``text`` as an EBNF string literal."""
    escaped = "".join(f"\\x{ord(c):02x}" if c in '"\\' or ord(c) < 0x20 else c for c in text)
    return f'"{escaped}"'
