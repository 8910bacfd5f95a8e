"""Speculative RAG benchmark data: the NQ / SQuAD / PubHealth questions with their corpora,
and the accuracy metric (answer containment; PubHealth's true/false verdict)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from shared_core.bench.common import data_dir, read_jsonl
from shared_core.config.data_splits import NQ_EVAL_ROWS, SQUAD_EVAL_TITLES
from shared_core.engines.speculative_rag import normalize_answer
from shared_core.retrieval.base import Document

DATASETS = ("nq", "squad", "pubhealth")
PUBHEALTH_CHUNK_WORDS = 120
PUBHEALTH_QUESTION = ("Is the following statement correct or not? Say true if it's correct; "
                      "otherwise, say false. Statement: {claim}")

# --------------------------------------------------------------------------- data


def load_dataset(name: str, limit: int, root: Path | None = None
                 ) -> tuple[list[Document], list[dict[str, Any]]]:
    """(corpus, questions) where each question has ``id``, ``question`` and ``gold``."""
    root = root or data_dir()
    if name == "nq":
        corpus = [Document(r["pid"], f"{r['title']}: {r['text']}")
                  for r in read_jsonl(root / "nq_open_oracle" / "corpus.jsonl")]
        rows = read_jsonl(root / "nq_open_oracle" / "questions.jsonl", min(limit, NQ_EVAL_ROWS))
        return corpus, [{"id": r["qid"], "question": r["question"], "gold": r["answers"]}
                        for r in rows]
    if name == "squad":
        corpus = [Document(r["pid"], f"{r['title'].replace('_', ' ')}: {r['text']}")
                  for r in read_jsonl(root / "squad_expmrc" / "corpus.jsonl")]
        rows = [r for r in read_jsonl(root / "squad_expmrc" / "questions.jsonl")
                if r["title"] in SQUAD_EVAL_TITLES][:limit]
        return corpus, [{"id": r["id"], "question": r["question"], "gold": sorted(set(r["answers"]))}
                        for r in rows]
    if name == "pubhealth":
        articles = (read_jsonl(root / "pubhealth" / "pubhealth_test_subset.jsonl")
                    + read_jsonl(root / "pubhealth" / "pubhealth_dev_subset.jsonl"))
        corpus = [Document(f"ph-{a['claim_id']}-{i}", chunk)
                  for a in articles for i, chunk in enumerate(_chunks(a["main_text"]))]
        rows = [a for a in articles if a["label"] in ("true", "false")][:limit]
        return corpus, [{"id": f"ph-{r['claim_id']}", "gold": [r["label"]],
                         "question": PUBHEALTH_QUESTION.format(claim=r["claim"])} for r in rows]
    msg = f"dataset must be one of {', '.join(DATASETS)}, got {name!r}"
    raise ValueError(msg)


def _chunks(text: str, size: int = PUBHEALTH_CHUNK_WORDS) -> list[str]:
    words = text.split()
    return [" ".join(words[i:i + size]) for i in range(0, len(words), size)] or [""]


# --------------------------------------------------------------------------- metrics


_FALSE_WORDS = re.compile(r"\b(?:not\s+(?:true|correct|accurate)|incorrect|inaccurate|untrue|false|"
                          r"no|misleading|wrong)\b")
_TRUE_WORDS = re.compile(r"\b(?:true|correct|accurate|yes|right)\b")


def claim_label(prediction: str) -> str | None:
    """"true"/"false" from a free-text verdict: whichever cue comes first ("not correct",
    "incorrect", "no", "false"… vs "correct", "yes", "true"…); None without any cue."""
    text = prediction.lower()
    cues = [(m.start(), "false") for m in [_FALSE_WORDS.search(text)] if m]
    cues += [(m.start(), "true") for m in [_TRUE_WORDS.search(text)] if m]
    return min(cues)[1] if cues else None


def is_correct(dataset: str, prediction: str, gold: list[str]) -> bool:
    if dataset == "pubhealth":
        return claim_label(prediction) == gold[0]
    pred = normalize_answer(prediction)
    return any(normalize_answer(g) and normalize_answer(g) in pred for g in gold)
