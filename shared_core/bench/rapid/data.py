"""RAPID benchmark data: L-Eval QuALITY items and the NQ long-context task (gold passage among
similar distractors), with their answer checks."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shared_core.bench.common import read_jsonl

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer
    from transformers import PreTrainedTokenizerBase

QUALITY_QUERY = "{question}\n\nAnswer with the letter of the correct option, e.g. (A)."
NQ_QUERY = "Question: {question}\nAnswer the question with a short phrase."
# the sweep measures decoding speed, so it asks for a long answer (the paper's outputs are long)
NQ_LONG_QUERY = ("Question: {question}\nAnswer the question, then explain in detail which "
                 "documents support the answer and what they say.")


@dataclass(frozen=True)
class Item:
    """One question over one long context, with what the scorer needs."""

    context: str
    query: str
    answers: tuple[str, ...]
    meta: dict[str, Any] = field(default_factory=dict)



# ---------------------------------------------------------------------------- data


def quality_items(root: Path, limit: int) -> list[Item]:
    """QuALITY questions, document by document (first ``limit``)."""
    items: list[Item] = []
    for doc_index, row in enumerate(read_jsonl(root / "long_context_leval" / "quality.jsonl")):
        for q_index, (question, answer) in enumerate(zip(row["instructions"], row["outputs"],
                                                         strict=True)):
            items.append(Item(row["input"], QUALITY_QUERY.format(question=question.strip()),
                              (answer.strip()[1],), {"doc": doc_index, "q": q_index}))
            if len(items) >= limit:
                return items
    return items


def quality_letter(text: str) -> str | None:
    """The first option letter in an answer: "(B)", "B)", "B." or a lone "B"."""
    match = re.search(r"\(([A-D])\)|\b([A-D])[).:]|\b([A-D])\b", text)
    return next((g for g in match.groups() if g), None) if match else None


def _passage(doc: dict[str, Any], number: int) -> str:
    return f"Document [{number}] (Title: {doc['title']}) {doc['text']}"


def _nq_corpus_vectors(corpus: list[dict[str, Any]], embedder: SentenceTransformer) -> np.ndarray:
    """MiniLM vectors of the 2,600 passages, cached on disk (not in the repository)."""
    from shared_core.runtime.models import cache_dir

    path = cache_dir() / "bench" / f"nq_corpus_{len(corpus)}_minilm.npy"
    if path.is_file():
        return np.asarray(np.load(path))
    texts = [f"{d['title']} {d['text']}" for d in corpus]
    vectors = np.asarray(embedder.encode(texts, batch_size=64, normalize_embeddings=True),
                         dtype=np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, vectors)
    return vectors


def nq_long_items(root: Path, embedder: SentenceTransformer, tokenizer: PreTrainedTokenizerBase,
                  limit: int, seed: int, target_tokens: int | None = None, n_distractors: int = 39,
                  query: str = NQ_QUERY) -> list[Item]:
    """Gold passage at a random position among similar distractors (fixed seed, recorded).

    With ``target_tokens`` the distractors are added until the context has about that many
    tokens (context-length sweep); otherwise ``n_distractors`` are used.
    """
    corpus = read_jsonl(root / "nq_open_oracle" / "corpus.jsonl")
    questions = read_jsonl(root / "nq_open_oracle" / "questions.jsonl")
    by_pid = {d["pid"]: i for i, d in enumerate(corpus)}
    vectors = _nq_corpus_vectors(corpus, embedder)
    rng = random.Random(seed)
    chosen = rng.sample(range(len(questions)), limit)
    q_vectors = np.asarray(embedder.encode([questions[i]["question"] for i in chosen],
                                           normalize_embeddings=True), dtype=np.float32)
    items = []
    for qi, q_vec in zip(chosen, q_vectors, strict=True):
        row = questions[qi]
        gold = by_pid[row["gold_pids"][0]]
        answers = [a.lower() for a in row["answers"]]
        order = np.argsort(-(vectors @ q_vec))
        distractors = [int(i) for i in order if int(i) != gold and not any(
            a in corpus[int(i)]["text"].lower() for a in answers)]
        picked = _pick_distractors(corpus, distractors, gold, tokenizer, target_tokens,
                                   n_distractors)
        position = rng.randrange(len(picked) + 1)
        docs = [*picked[:position], gold, *picked[position:]]
        context = "\n\n".join(_passage(corpus[d], n + 1) for n, d in enumerate(docs))
        items.append(Item(context, query.format(question=row["question"]),
                          tuple(row["answers"]), {"qid": row["qid"], "gold_position": position,
                                                  "passages": len(docs)}))
    return items


def _pick_distractors(corpus: list[dict[str, Any]], distractors: list[int], gold: int,
                      tokenizer: PreTrainedTokenizerBase, target_tokens: int | None, n: int) -> list[int]:
    if target_tokens is None:
        return distractors[:n]
    def size(i: int) -> int:
        return len(tokenizer.encode(_passage(corpus[i], 99) + "\n\n", add_special_tokens=False))

    total, picked = size(gold), []
    for i in distractors:
        if total + size(i) > target_tokens:
            break
        picked.append(i)
        total += size(i)
    return picked


def contains_answer(text: str, answers: Sequence[str]) -> bool:
    low = text.lower()
    return any(a.lower() in low for a in answers)
