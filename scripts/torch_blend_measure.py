"""Blended prefill vs full prefill on real RAG prompts (torch, CPU): quality and time per share.

    flock /tmp/specrag-bench.lock python scripts/torch_blend_measure.py --per-dataset 8 \
        --out results/system/2026-11-27-passage-cache/torch_blend_smollm2.json

For each question of NQ / SQuAD / PubHealth (``shared_core.bench.specrag.data``), BM25 retrieves
``--docs`` passages from the dataset's corpus and the standard RAG prompt is built as token pieces
(the head up to ``Document [1]:``, each passage, the labels and the question between them); each
passage's KV is read alone after that head, then :func:`measure_blend` compares blends with a full
prefill of the same ids.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from shared_core.bench.specrag.data import load_dataset
from shared_core.bench.system.blend_measure import Case, measure_blend, summarize
from shared_core.engines.speculative_rag.prompts import RAG_INSTRUCTION
from shared_core.retrieval.bm25 import BM25Retriever
from shared_core.runtime.lm import LM
from shared_core.runtime.models import load_lm
from shared_core.util.device import cpu_facts

logger = logging.getLogger("torch_blend_measure")
MARK = "\x00"


def build_case(lm: LM, question: str, passages: list[str]) -> Case:
    """The standard RAG prompt (``rag_prompt``'s text) as pieces around the passages."""
    pre, post = (lm.chat_prompt([{"role": "user", "content": MARK}]) + "Answer:").split(MARK)
    head = lm.encode(f"{pre}{RAG_INSTRUCTION}\n\nDocument [1]:")
    chunks = [lm.encode(" " + " ".join(p.split())) for p in passages]
    between = [lm.encode(f"\nDocument [{i + 2}]:") for i in range(len(passages) - 1)]
    between.append(lm.encode(f"\n\nQuestion: {question}{post}"))
    return Case(head, chunks, between)


def cases_for(lm: LM, dataset: str, count: int, docs: int) -> list[Case]:
    corpus, questions = load_dataset(dataset, count)
    retriever = BM25Retriever()
    retriever.add(corpus)
    hits = retriever.search([q["question"] for q in questions], docs)
    return [build_case(lm, q["question"], [h.document.text for h in row])
            for q, row in zip(questions, hits, strict=True)]


def _earlier_rows(path: str) -> list[dict[str, Any]]:
    """The cases an earlier (time-limited) run of the same settings saved in ``path``."""
    if not Path(path).exists():
        return []
    rows = json.loads(Path(path).read_text(encoding="utf-8")).get("cases", [])
    for row in rows:  # files written before rows carried their index: saved in question order
        row.setdefault("index", sum(r["dataset"] == row["dataset"] for r in rows[:rows.index(row)]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--datasets", default="nq,squad,pubhealth")
    parser.add_argument("--per-dataset", type=int, default=8)
    parser.add_argument("--docs", type=int, default=5)
    parser.add_argument("--decode", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="timings: the fastest of N runs")
    parser.add_argument("--shares", default="0,0.05,0.15,0.3,1")
    parser.add_argument("--select-layer", type=int, default=1)
    parser.add_argument("--selects", default="deviation,chunk_start,random")
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", action="store_true",
                        help="keep the cases --out already holds and measure the others")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(int(os.environ.get("SPECRAG_NUM_THREADS", "1")))
    lm = load_lm(args.model, backend="torch")
    report: dict[str, Any] = {"model": args.model, "backend": "torch", "dtype": str(lm.dtype),
                              "machine_before": cpu_facts(), "args": vars(args)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    cases = {d: cases_for(lm, d, args.per_dataset, args.docs) for d in args.datasets.split(",")}
    rows: list[dict[str, Any]] = _earlier_rows(args.out) if args.resume else []
    done = {(r["dataset"], r["index"]) for r in rows}
    # one question of each dataset in turn: a run cut short by its time limit stays balanced
    order = [(d, i) for i in range(args.per_dataset) for d in cases
             if i < len(cases[d]) and (d, i) not in done]
    for dataset, index in order:
        def save(row: dict[str, Any], dataset: str = dataset, index: int = index) -> None:
            rows.append({"dataset": dataset, "index": index, "load_avg": os.getloadavg(), **row})
            report["cases"] = rows
            report["summary_all"] = summarize(rows)
            report["summary"] = {d: summarize([r for r in rows if r["dataset"] == d])
                                 for d in cases}
            report["wall_s"] = time.perf_counter() - began
            report["machine_after"] = cpu_facts()
            Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n",
                                      encoding="utf-8")

        measure_blend(lm, [cases[dataset][index]], selects=args.selects.split(","),
                      shares=[float(x) for x in args.shares.split(",")], decode=args.decode,
                      repeats=args.repeats, select_layer=args.select_layer, on_case=save)
    for line in report["summary_all"]:
        logger.info("%s", line)


if __name__ == "__main__":
    main()
