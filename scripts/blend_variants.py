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
- select: ``dev`` (CacheBlend's layer-1 deviation), ``devN`` (the deviation at layer N), ``lead``
  (the first share of each passage), ``leadN`` (the first N ids of each passage, LegoLink-style),
  ``qa`` (windows around the passage ids that also occur in the question, nearest first),
  ``qadev`` (half the share by ``qa``, the rest by ``dev``);
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
    question: Sequence[int] = ()
    _spans: Sequence[Any] = ()

    def _select(self, lm: Any, ids: list[int], placed: Any, report: Any) -> Any:
        self._spans = [span for span, _ in placed]
        if self.select.startswith("dev"):
            self.probe_layer = int(self.select[3:] or 1)
            return super()._select(lm, ids, placed, report)
        if self.select in ("qa", "qadev"):
            return self._question_runs(lm, ids, placed, report)
        runs = []
        for span in self._spans:
            n = (round(self.config.recompute_share * len(span)) if self.select == "lead"
                 else min(int(self.select[4:]), len(span)))
            if n:
                runs.append((span.start, span.start + n))
        return runs

    def _question_runs(self, lm: Any, ids: list[int], placed: Any, report: Any) -> Any:
        """Windows around passage ids that occur in the question (ids of >= 3 characters), the
        window widened one id at a time on every hit until the share is spent."""
        total = sum(len(span) for span, _ in placed)
        budget = round(self.config.recompute_share * total)
        chosen: set[int] = set()
        if self.select == "qadev":
            share = self.config.recompute_share
            self.config = PassageCacheConfig("blend", share / 2)
            try:
                for a, b in super()._select(lm, ids, placed, report):
                    chosen.update(range(a, b))
            finally:
                self.config = PassageCacheConfig("blend", share)
        words = {t for t in self.question if len(lm.tokenizer.decode([t]).strip()) >= 3}
        hits = [p for span, _ in placed for p in range(span.start, span.end) if ids[p] in words]
        inside = [(span.start, span.end) for span, _ in placed]
        width = 0
        while hits and len(chosen) < budget and width < 64:
            for p in hits:
                for q in (p - width, p + width):
                    if len(chosen) < budget and any(a <= q < b for a, b in inside):
                        chosen.add(q)
            width += 1
        from shared_core.runtime.passage_cache.llamacpp import _runs

        return _runs(sorted(chosen))

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


def _warm_in_context(lm: Any, cache: _Variant, docs: Sequence[Any], other: Sequence[Any]) -> None:
    """Store each passage of ``docs`` as read in a RAG prompt beside ``other``'s first passages
    (another question's: what a stream's first read of it would have seen), shifted to start
    after the head as an alone-read entry does."""
    from shared_core.runtime.passage_cache.llamacpp import PLACE_SEQ, _seq_state

    llama = lm.model.llama
    register_passages(lm, passage_texts(other))
    for place, doc in enumerate(docs):
        mixed = [*list(other)[: len(docs) - 1]]
        index = min(place, len(mixed))
        mixed.insert(index, doc)
        ids = rag_prompt(lm, "What does it say?", mixed)
        spans = cache.chunks_of(ids)
        if len(spans) != len(mixed):
            raise RuntimeError(f"{len(spans)} chunks found for {len(mixed)} passages")
        span = spans[index]
        if cache.store.key("chunk", cache.head, ids[span.start:span.end]) in cache.store:
            continue
        lm.model.passage_cache = None
        session = lm.open_session()
        session.prefill(ids)
        lm.model.passage_cache = cache
        chunk = ids[span.start:span.end]
        memory, ctx = session.slot.memory, session.slot.ctx
        llama.llama_memory_seq_rm(memory, PLACE_SEQ, -1, -1)
        llama.llama_memory_seq_cp(memory, 0, PLACE_SEQ, span.start, span.end)
        llama.llama_memory_seq_rm(memory, 0, -1, -1)
        session.tokens = []
        llama.llama_memory_seq_add(memory, PLACE_SEQ, span.start, span.end,
                                   len(cache.head) - span.start)
        cache.store.put(cache.store.key("chunk", cache.head, chunk), _seq_state(llama, ctx, PLACE_SEQ))
        llama.llama_memory_seq_rm(memory, PLACE_SEQ, -1, -1)
        session.slot.clear()


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
        previous: Sequence[Any] = ()
        for question, docs in _questions(dataset, limit, 5):
            other = [d for d in previous if d not in docs] or list(docs)
            previous = docs
            ids = rag_prompt(lm, question["question"], docs)
            heads["sink"] = tuple(ids[:1])
            lm.model.passage_cache = None
            full = _answer(lm, ids, MAX_NEW)
            row: dict[str, Any] = {"ds": dataset, "id": question["id"], "n": len(ids),
                                   "full_ok": is_correct(dataset, full["text"], question["gold"]),
                                   "full_ttft": full["ttft_s"], "m": {}}
            for name in variants:
                head, select, order, share = name.split(":")
                context = head.startswith("ctx")
                head = head[3:] or "chat" if context else head
                if name not in caches:
                    config = (PassageCacheConfig("blend", float(share), memory_mb=4096, disk_mb=0)
                              if context else PassageCacheConfig("blend", float(share)))
                    cache = _Variant(lm.model, config, head=heads[head])
                    cache.select, cache.order = select, order
                    caches[name] = cache
                lm.model.passage_cache = caches[name]
                caches[name].question = tuple(
                    {*lm.tokenizer.encode(question["question"]),
                     *lm.tokenizer.encode(" " + question["question"])})
                register_passages(lm, passage_texts(docs))
                if context:
                    _warm_in_context(lm, caches[name], docs, other)
                else:
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
