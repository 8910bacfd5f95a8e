"""Schema-constrained decoding with xgrammar, as a logits mask every engine applies alike.

A :class:`Constraint` is the torch-free description an adapter builds (a JSON schema, any JSON
value, optionally followed by fixed text such as the ``}`` that closes a prefilled tool call, or
an xgrammar structural tag: free text in which each tagged region, e.g. a tool call, follows its
own schema);
:func:`grammar_mask` compiles it for one model's tokenizer into a :class:`GrammarMask`, the
``LogitsMask`` of the engines' round loop:

- ``mask(logits, drafted)`` masks row ``i`` of one verification forward with the grammar state
  after ``committed + drafted[:i]``: the drafted tokens are accepted tentatively and rolled back
  before returning, so speculated positions are masked exactly as verified ones and the
  committed state never changes. Rows after the first drafted token the grammar rejects stay
  unmasked (verification stops there anyway: that token is masked out of the row scoring it).
- ``commit(tokens)`` advances by what a round emitted; tokens after a stop token are ignored.

Greedy decoding over masked logits is the argmax of the constrained distribution, so a lossless
engine with this mask equals constrained greedy decoding token for token.

xgrammar (and torch) are imported on first use; the tokenizer tables and the grammar compiler
are built once per tokenizer (≈1 s for a 49k vocabulary).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from xgrammar import CompiledGrammar

    from shared_core.runtime.protocol import SessionLM

CONSTRAINT_KINDS = ("json_schema", "json", "structural_tag")
_COMPILERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


@dataclass(frozen=True)
class Constraint:
    """What the output must be: ``kind="json_schema"`` with ``schema`` (a JSON-schema dict),
    ``kind="json"`` (any JSON object) or ``kind="structural_tag"`` with ``schema`` (an xgrammar
    structural tag as a dict); then the literal ``suffix`` (may be empty)."""

    kind: str
    schema: dict[str, Any] | None = None
    suffix: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            msg = f"constraint kind={self.kind!r} is not one of {list(CONSTRAINT_KINDS)}"
            raise ValueError(msg)
        if self.kind != "json" and not isinstance(self.schema, dict):
            msg = (f"a {self.kind} constraint needs schema= as a dict, got "
                   f"{type(self.schema).__name__}")
            raise TypeError(msg)
        if not isinstance(self.suffix, str):
            msg = f"constraint suffix must be a string, got {type(self.suffix).__name__}"
            raise TypeError(msg)

    def json_schema(self) -> dict[str, Any]:
        """The JSON schema of a ``json_schema`` / ``json`` constraint: ``"json"`` is JSON mode
        (OpenAI's json_object), any object, never a bare array or scalar."""
        if self.kind == "json":
            return {"type": "object"}
        assert self.kind == "json_schema" and self.schema is not None, self.kind
        return self.schema


JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def _check_schema_node(node: object, where: str) -> None:
    """The ``type`` keywords of a schema and its subschemas (a bool is a valid schema)."""
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        msg = f"{where} must be a JSON schema (a dict), got {type(node).__name__} {node!r:.60}"
        raise TypeError(msg)
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "type" in node and not all(isinstance(k, str) and k in JSON_TYPES for k in kinds):
        msg = f"{where}: 'type' must be one of {list(JSON_TYPES)} (or a list of them), got {kind!r}"
        raise ValueError(msg)
    for key in _SUBSCHEMA:
        if key in node and not isinstance(node[key], list):
            _check_schema_node(node[key], f"{where}.{key}")
    for key in _SUBSCHEMA_LISTS:
        for j, sub in enumerate(node.get(key) or ()):
            _check_schema_node(sub, f"{where}.{key}[{j}]")
    for key in _SUBSCHEMA_MAPS:
        subs = node.get(key) or {}
        if not isinstance(subs, dict):
            msg = f"{where}.{key} must be a dict of JSON schemas, got {type(subs).__name__}"
            raise TypeError(msg)
        for name, sub in subs.items():
            _check_schema_node(sub, f"{where}.{key}.{name}")


def check_json_schema(schema: Any, name: str = "schema") -> dict[str, Any] | bool:
    """``schema`` if it is a JSON schema a constraint can be built from, else a TypeError /
    ValueError naming ``name``, raised before any model work (not when decoding starts).

    Checks the ``type`` keywords of every subschema; with xgrammar installed, the schema is also
    compiled to its grammar (tokenizer-free, milliseconds), which finds everything else.
    """
    _check_schema_node(schema, name)
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as e:
        msg = f"{name} must be JSON-serialisable: {e}"
        raise TypeError(msg) from None
    if xgrammar_available():
        import xgrammar as xgr

        try:
            xgr.Grammar.from_json_schema(text, any_whitespace=False)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with its parser's text
            msg = f"{name} is not a usable JSON schema: {e}"
            raise ValueError(msg) from None
    checked: dict[str, Any] | bool = schema  # a dict, or a bool (a valid schema too)
    return checked


def xgrammar_available() -> bool:
    """True if xgrammar can be imported (the ``constrained`` extra)."""
    import importlib.util

    return importlib.util.find_spec("xgrammar") is not None


def _compiler(lm: SessionLM) -> Any:
    """One xgrammar compiler per tokenizer (its tables cost about a second to build)."""
    import xgrammar as xgr

    with _COMPILERS_LOCK:
        compiler = _COMPILERS.get(lm.tokenizer)
        if compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                lm.tokenizer, vocab_size=lm.vocab_size, stop_token_ids=sorted(lm.eos_token_ids))
            compiler = xgr.GrammarCompiler(info, max_threads=1)
            _COMPILERS[lm.tokenizer] = compiler
        return compiler


def compile_constraint(lm: SessionLM, constraint: Constraint) -> Any:
    """The xgrammar ``CompiledGrammar`` of a constraint for this model's tokenizer."""
    import xgrammar as xgr

    compiler = _compiler(lm)
    if constraint.kind == "structural_tag":
        body = xgr.Grammar.from_structural_tag(json.dumps(constraint.schema))
    else:
        # compact separators: a fixed layout leaves a small model no whitespace to loop on
        body = xgr.Grammar.from_json_schema(json.dumps(constraint.json_schema()),
                                            any_whitespace=False)
    if constraint.suffix:
        body = xgr.Grammar.concat(body, xgr.Grammar.from_ebnf(
            f"root ::= {json.dumps(constraint.suffix)}"))
    return compiler.compile_grammar(body)


class GrammarMask:
    """An xgrammar matcher as the engines' ``LogitsMask`` (see the module docstring)."""

    def __init__(self, compiled: CompiledGrammar, vocab_size: int):
        import xgrammar as xgr

        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._vocab_size = vocab_size

    def mask(self, logits: torch.Tensor, drafted: Sequence[int]) -> torch.Tensor:
        """``logits`` [len(drafted) + 1, vocab] with the grammar's forbidden tokens at -inf."""
        rows = len(drafted) + 1
        if logits.dim() != 2 or logits.shape[0] != rows:
            msg = f"logits must have shape [len(drafted) + 1 = {rows}, vocab], got {tuple(logits.shape)}"
            raise ValueError(msg)
        matcher, xgr = self._matcher, self._xgr
        bitmask = xgr.allocate_token_bitmask(rows, self._vocab_size)
        filled, accepted = 0, 0
        try:
            for i in range(rows):
                if matcher.is_terminated():
                    break
                matcher.fill_next_token_bitmask(bitmask, i)
                filled += 1
                if i == rows - 1 or not matcher.accept_token(int(drafted[i])):
                    break
                accepted += 1
        finally:
            if accepted:
                matcher.rollback(accepted)
        out = logits.float().clone()
        if filled:
            # the matcher fills a CPU bitmask; xgrammar's CUDA kernel wants it beside the logits
            xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), vocab_size=self._vocab_size,
                                            indices=list(range(filled)))
        return out

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance by the tokens a round emitted (ignoring any after a stop token)."""
        for token in tokens:
            if self._matcher.is_terminated():
                return
            if not self._matcher.accept_token(int(token)):
                msg = (f"token {int(token)} was emitted but the grammar forbids it: the engine "
                       "did not apply this mask to the row that chose it")
                raise RuntimeError(msg)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


def grammar_mask(lm: SessionLM, constraint: Constraint) -> GrammarMask:
    """A fresh mask (one per generation) for ``constraint`` on this model's tokenizer."""
    return GrammarMask(compile_constraint(lm, constraint), lm.vocab_size)
