"""Speculative RAG benchmark records: one JSON line per question with every method's answer,
stats and drafts, so that a long run continues in a later session (``--resume``) and the
selection study re-runs offline on the very drafts and scores.

The first line holds the run's signature (models, backend, engine config, methods); a resumed
run must have the same one, else its numbers would mix two setups.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shared_core.engines.speculative_rag.results import (
    AnswerDraft,
    SpeculativeRAGResult,
    SpeculativeRAGStats,
    StandardRAGResult,
    StandardRAGStats,
)
from shared_core.retrieval.base import Document

logger = logging.getLogger(__name__)

Output = SpeculativeRAGResult | StandardRAGResult


def records_path(out: str | None) -> Path | None:
    """The records file beside a JSON report (``x.json`` -> ``x.records.jsonl``)."""
    return None if out is None else Path(out).with_suffix(".records.jsonl")


def record_of(output: Output) -> dict[str, Any]:
    """A JSON-ready record of one method's answer to one question (document texts left out)."""
    record: dict[str, Any] = {"text": output.text, "doc_ids": [d.id for d in output.documents],
                              "stats": output.stats.as_dict()}
    if isinstance(output, SpeculativeRAGResult):
        record.update(kind="specrag", rationale=output.rationale, best=output.best,
                      drafts=[asdict(d) for d in output.drafts])
    else:
        record.update(kind="standard", raw=output.raw)
    return record


def output_of(record: dict[str, Any]) -> Output:
    """The result a record was written from (documents carry their ids only)."""
    docs = tuple(Document(i, "") for i in record["doc_ids"])
    if record["kind"] == "standard":
        return StandardRAGResult(text=record["text"], raw=record["raw"], documents=docs,
                                 stats=StandardRAGStats(**record["stats"]))
    drafts = tuple(AnswerDraft(**{**d, "doc_ids": tuple(d["doc_ids"]),
                            "doc_indices": tuple(d["doc_indices"])}) for d in record["drafts"])
    return SpeculativeRAGResult(text=record["text"], rationale=record["rationale"],
                                best=record["best"], drafts=drafts, documents=docs,
                                stats=SpeculativeRAGStats(**record["stats"]))


def load_records(path: Path, signature: dict[str, Any]) -> dict[str, dict[str, Output]]:
    """Question id -> method -> result of an earlier run with this signature ({} if none)."""
    if not path.is_file():
        return {}
    lines = _read_lines(path)
    if not lines or lines[0].get("signature") != signature:
        msg = (f"{path} was written by a run with other settings; pass another --out or delete it "
               f"(its signature: {lines[0].get('signature') if lines else None}, "
               f"this run's: {signature})")
        raise ValueError(msg)
    done = {row["id"]: {m: output_of(r) for m, r in row["methods"].items()} for row in lines[1:]}
    logger.info("resuming from %s: %d questions already measured", path, len(done))
    return done


def _read_lines(path: Path) -> list[dict[str, Any]]:
    """The file's rows; a last line cut off by an interrupted write is dropped from the file."""
    texts = [t for t in path.read_text(encoding="utf-8").splitlines() if t.strip()]
    rows = []
    for i, text in enumerate(texts):
        try:
            rows.append(json.loads(text))
        except json.JSONDecodeError:
            if i != len(texts) - 1:
                raise
            logger.warning("%s: dropping a last line cut off mid-write", path)
            path.write_text("".join(t + "\n" for t in texts[:-1]), encoding="utf-8")
    return rows


def start_records(path: Path, signature: dict[str, Any]) -> None:
    """Begin a records file (an existing one with this signature is kept, for resuming)."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"signature": signature}) + "\n", encoding="utf-8")


def append_record(path: Path, question_id: str, outputs: dict[str, Output]) -> None:
    """Add one question's results (one line, flushed: an interrupted run keeps every finished
    question)."""
    row = {"id": question_id, "methods": {m: record_of(o) for m, o in outputs.items()}}
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")
