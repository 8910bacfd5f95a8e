"""Which blend variant restores a full prefill best: chunk head x selection rule x decode order x
recompute share, on the llama.cpp passage cache, first-token KL / answers / accuracy against a
full prefill of the same prompt (the passage-cache benchmark's questions and RAG prompt).

Run from the repository root (results: ``results/system/2026-11-28-blend-variants``)::

    PYTHONPATH=. python scripts/blend_variants.py qwen2.5-coder-0.5b-instruct squad,nq 15 out.json \\
        none:dev:batch:0.15,tmpl:dev:chunk:0.15,chat:dev:chunk:0.15

A variant is ``head:select:order:share``:

- head: ``none`` (a passage read alone from position 0), ``sink`` (after the prompt's first id),
  ``tmpl`` (after the RAG prompt's own head, up to "Document [1]:"), ``chat`` (after the model's
  chat opener, :func:`shared_core.runtime.passage_cache.chunk_head`);
- select: ``dev`` (CacheBlend's layer-1 deviation), ``lead`` (the first share of each passage),
  ``leadN`` (the first N ids of each passage, LegoLink-style);
- order: ``batch`` (every selected run in one decode), ``chunk`` (one decode per passage, in
  order: the cache's own), ``seq`` (one decode per run).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from shared_core.bench.specrag.data import is_correct
from shared_core.bench.system.passage_cache import _answer, _load, _questions
from shared_core.config import PassageCacheConfig
from shared_core.engines.speculative_rag.prompts import passage_texts, rag_prompt
from shared_core.runtime.passage_cache import chunk_head, register_passages, warm_passages
from shared_core.runtime.passage_cache.llamacpp import LlamaCppPassageCache, _by_chunk

logger = logging.getLogger("blend_variants")
MAX_NEW = 16


class _Variant(LlamaCppPassageCache):
    """The cache with its selection rule and its decode order replaced."""

    select = "dev"
    order = "chunk"
    _spans: Sequence[Any] = ()

    def _select(self, lm: Any, ids: list[int], placed: Any, report: Any) -> Any:
        self._spans = [span for span, _ in placed]
        if self.select == "dev":
            return super()._select(lm, ids, placed, report)
        runs = []
        for span in self._spans:
            n = (round(self.config.recompute_share * len(span)) if self.select == "lead"
                 else min(int(self.select[4:]), len(span)))
            if n:
                runs.append((span.start, span.start + n))
        return runs

    def _decode_runs(self, lm: Any, slot: Any, seq: int, ids: list[int], runs: Any,
                     scratch: Sequence[int]) -> int:
        if self.order == "seq":
            return sum(super(_Variant, self)._decode_runs(lm, slot, seq, ids, [run], scratch)
                       for run in runs)
        return super()._decode_runs(lm, slot, seq, ids, runs, scratch)

    def fill(self, *args: Any, **kwargs: Any) -> int:
        if self.order != "batch":
            return super().fill(*args, **kwargs)
        import shared_core.runtime.passage_cache.llamacpp as module

        module._by_chunk = lambda runs, spans: [list(runs)] if runs else []
        try:
            return super().fill(*args, **kwargs)
        finally:
            module._by_chunk = _by_chunk


def _template_head(lm: Any, dataset: str) -> tuple[int, ...]:
    """The RAG prompt's own head: the common prefix of two prompts, up to "Document [1]:"."""
    first, second = (rag_prompt(lm, q["question"], d) for q, d in _questions(dataset, 2, 5))
    n = 0
    while first[n] == second[n]:
        n += 1
    head = first[:n]
    while not lm.tokenizer.decode(head).endswith("Document [1]:"):
        head = head[:-1]
    return tuple(head)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model, datasets, limit, out = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), sys.argv[4]
    variants = sys.argv[5].split(",")
    lm = _load(model, "llama.cpp", 4096, exact=False)
    heads = {"none": (), "tmpl": _template_head(lm, datasets[0]), "chat": chunk_head(lm)}
    caches: dict[str, _Variant] = {}
    rows = []
    for dataset in datasets:
        for question, docs in _questions(dataset, limit, 5):
            ids = rag_prompt(lm, question["question"], docs)
            heads["sink"] = tuple(ids[:1])
            lm.model.passage_cache = None
            full = _answer(lm, ids, MAX_NEW)
            row: dict[str, Any] = {"ds": dataset, "id": question["id"], "n": len(ids),
                                   "full_ok": is_correct(dataset, full["text"], question["gold"]),
                                   "full_ttft": full["ttft_s"], "m": {}}
            for name in variants:
                head, select, order, share = name.split(":")
                if name not in caches:
                    cache = _Variant(lm.model, PassageCacheConfig("blend", float(share)),
                                     head=heads[head])
                    cache.select, cache.order = select, order
                    caches[name] = cache
                lm.model.passage_cache = caches[name]
                register_passages(lm, passage_texts(docs))
                warm_passages(lm, passage_texts(docs), progress=False)
                got = _answer(lm, ids, MAX_NEW)
                ref, logp = full["_logp"], got["_logp"]
                kl = float(np.sum(np.exp(ref) * (ref - logp)))
                row["m"][name] = {"kl": kl, "first": got["tokens"][0] == full["tokens"][0],
                                  "same": got["tokens"] == full["tokens"],
                                  "ok": is_correct(dataset, got["text"], question["gold"]),
                                  "ttft": got["ttft_s"]}
            lm.model.passage_cache = None
            rows.append(row)
            logger.info("%s %s %s", dataset, question["id"],
                        {k: round(v["kl"], 3) for k, v in row["m"].items()})
    with open(out, "w") as handle:
        json.dump(rows, handle)
    logger.info("%-28s %6s %6s %6s %6s %8s %9s", "variant", "KL", "first", "same", "acc",
                "full_acc", "ttft/full")
    for name in variants:
        def mean(key: str, name: str = name) -> float:
            return float(np.mean([r["m"][name][key] for r in rows]))
        logger.info("%-28s %6.3f %6.2f %6.2f %6.2f %8.2f %9.2f", name, mean("kl"), mean("first"),
                    mean("same"), mean("ok"), np.mean([r["full_ok"] for r in rows]),
                    np.median([r["m"][name]["ttft"] / r["full_ttft"] for r in rows]))


if __name__ == "__main__":
    main()
