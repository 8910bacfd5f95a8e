"""Torch passage cache on SmolLM2-135M (fp32, CPU, one thread), through ``load_lm``'s setting:
blend (recompute shares 0 / 0.15 / 0.3) against a full prefill (first token, 8 greedy tokens),
and exact (warm vs cold vs a plain prefill) on 8 RAG prompts of 3 passages in several orders.
Prints one JSON line per setting. Run from the repository root:
``PYTHONPATH=. python scripts/torch_passage_cache_check.py``."""

from __future__ import annotations

import json
import sys

import torch

from shared_core.config import PassageCacheConfig
from shared_core.runtime.models import load_lm
from shared_core.runtime.passage_cache import attach, register_passages, warm_passages

PASSAGES = [
    "The Hollin Weir was built in 1874 by the engineer Marta Quell to control the river Dast. It "
    "has eleven sluice gates, each named after a month except June.",
    "The weir keeper's cottage, painted blue, stands on the east bank next to the fish ladder. "
    "Visitors may enter it on Sundays between May and September.",
    "Marta Quell later designed the Orrin aqueduct, which carries water forty kilometres to the "
    "city of Bellmark across the Sedge valley.",
    "The Iron Bridge over the Severn is 840 meters long and opened to traffic in 1968 after six "
    "years of work.",
    "Marta Kovac designed the Iron Bridge; she later led the city's harbor authority until 1990.",
    "The harbor of Port Alder was built in 1712 and enlarged twice, in 1850 and in 1931.",
]
QUESTIONS = [
    ("Who built the weir?", (0, 1, 2)), ("What colour is the cottage?", (2, 0, 1)),
    ("Where does the aqueduct carry water?", (1, 2, 0)), ("Who built the weir?", (2, 1, 0)),
    ("Who designed the bridge that opened in 1968?", (3, 4, 5)),
    ("When was the harbor of Port Alder built?", (5, 3, 4)),
    ("How long is the Iron Bridge?", (4, 5, 3)),
    ("Who designed the bridge that opened in 1968?", (5, 4, 3)),
]
N = 8


def main() -> None:
    torch.set_num_threads(1)
    lm = load_lm("smollm2-135m-instruct", backend="torch", prefix_cache=False)

    def prompt(order: tuple[int, ...], question: str) -> list[int]:
        docs = "\n\n".join(f"Document [{i + 1}]: {PASSAGES[p]}" for i, p in enumerate(order))
        text = f"Answer using the documents.\n\n{docs}\n\nQuestion: {question}"
        return lm.prompt_ids([{"role": "user", "content": text}])

    def greedy(ids: list[int]) -> tuple[list[int], object]:
        session = lm.open_session()
        logits, out = session.prefill(ids), []
        for _ in range(N):
            out.append(int(logits.argmax()))
            logits = session.extend([out[-1]])[-1]
        return out, session.passage_report

    cases = [prompt(order, question) for question, order in QUESTIONS]
    full = [greedy(ids)[0] for ids in cases]
    for share in (0.0, 0.15, 0.3):
        attach(lm.model, PassageCacheConfig(mode="blend", recompute_share=share, disk_mb=0))
        register_passages(lm, PASSAGES)
        warm_passages(lm, PASSAGES, progress=False)
        row = {"mode": "blend", "share": share, "cases": len(cases), "first_token_equal": 0,
               f"{N}_tokens_equal": 0, "reused": 0, "recomputed": 0, "prompt_tokens": 0}
        for ids, reference in zip(cases, full, strict=True):
            out, report = greedy(ids)
            row["first_token_equal"] += out[0] == reference[0]
            row[f"{N}_tokens_equal"] += out == reference
            row["reused"] += report.reused
            row["recomputed"] += report.recomputed
            row["prompt_tokens"] += report.prompt
        sys.stdout.write(json.dumps(row) + "\n")
    attach(lm.model, PassageCacheConfig(mode="exact", disk_mb=0))
    row = {"mode": "exact", "cases": len(cases), "warm_equals_cold_and_plain": 0, "reused": 0}
    for ids, reference in zip(cases, full, strict=True):
        cold, _ = greedy(ids)
        warm, report = greedy(ids)
        row["warm_equals_cold_and_plain"] += cold == warm == reference
        row["reused"] += report.reused
    sys.stdout.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
