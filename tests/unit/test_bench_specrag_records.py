"""The Speculative RAG benchmark's records: a question's results survive a round trip, a run
with other settings is refused, and a line cut off by an interrupted write is dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared_core.bench.specrag.records import (
    append_record,
    load_records,
    record_of,
    records_path,
    start_records,
)
from shared_core.engines.speculative_rag import (
    AnswerDraft,
    SpeculativeRAGResult,
    SpeculativeRAGStats,
    StandardRAGResult,
    StandardRAGStats,
)
from shared_core.retrieval.base import Document

SIGNATURE = {"dataset": "nq", "methods": ["rag_verifier", "specrag"]}


def _results() -> dict:
    docs = (Document("d0", "text zero"), Document("d1", "text one"))
    draft = AnswerDraft("Paris", "because", "Rationale: because\nAnswer: Paris", ("d0", "d1"), (0, 1),
                  True, log_draft=-1.5, log_self_contain=-3.25, log_self_reflect=-0.5,
                  score=-5.25, draft_tokens=7, self_contain_tokens=9)
    spec = SpeculativeRAGResult("Paris", "because", 0, (draft,), docs,
                                SpeculativeRAGStats(num_documents=2, draft_prefill_s=0.25,
                                                    draft_decode_s=0.5, verify_s=0.125,
                                                    cluster_sizes=[1, 1]))
    std = StandardRAGResult("Lyon", "Answer: Lyon", docs,
                            StandardRAGStats(prompt_tokens=40, prefill_s=1.0, decode_s=0.5))
    return {"specrag": spec, "rag_verifier": std}


def test_records_round_trip(tmp_path: Path) -> None:
    path = records_path(str(tmp_path / "r.json"))
    assert path == tmp_path / "r.records.jsonl"
    start_records(path, SIGNATURE)
    results = _results()
    append_record(path, "q1", results)
    [restored] = load_records(path, SIGNATURE).values()
    spec, std = restored["specrag"], restored["rag_verifier"]
    assert spec.drafts == results["specrag"].drafts  # every score, index and id
    assert spec.stats == results["specrag"].stats and std.stats == results["rag_verifier"].stats
    assert (spec.text, spec.best, std.text, std.raw) == ("Paris", 0, "Lyon", "Answer: Lyon")
    assert [d.id for d in spec.documents] == ["d0", "d1"]
    assert record_of(spec) == record_of(results["specrag"]) | {
        "doc_ids": ["d0", "d1"]}  # texts are not stored, ids are


def test_records_refuse_other_settings(tmp_path: Path) -> None:
    path = tmp_path / "r.records.jsonl"
    start_records(path, SIGNATURE)
    with pytest.raises(ValueError, match="other settings"):
        load_records(path, {**SIGNATURE, "dataset": "squad"})
    assert load_records(tmp_path / "none.jsonl", SIGNATURE) == {}


def test_records_drop_a_line_cut_mid_write(tmp_path: Path) -> None:
    path = tmp_path / "r.records.jsonl"
    start_records(path, SIGNATURE)
    append_record(path, "q1", _results())
    full = path.read_text()
    path.write_text(full + json.dumps({"id": "q2", "methods": {}})[:15])  # killed mid-line
    assert list(load_records(path, SIGNATURE)) == ["q1"]
    assert path.read_text() == full  # the next append starts on a line of its own
    append_record(path, "q2", _results())
    assert list(load_records(path, SIGNATURE)) == ["q1", "q2"]


def test_grid_points_parse_and_refuse() -> None:
    from shared_core.bench.specrag import FULL_GRID, grid_points

    assert grid_points("5x1,3x2") == [(5, 1), (3, 2)]
    assert grid_points(None) == []
    assert len(grid_points(FULL_GRID)) == 6
    for bad in ("5", "5x", "x2", "0x2", "5by2", "-1x2"):
        with pytest.raises(ValueError, match="--grid takes MxK"):
            grid_points(bad)


def test_draft_quality_says_why_a_selection_cannot_win() -> None:
    from dataclasses import replace

    from shared_core.bench.specrag.selection import draft_quality

    spec = _results()["specrag"]
    wrong = replace(spec.drafts[0], answer="false, it is not")
    two = replace(spec, drafts=(spec.drafts[0], wrong),
                  stats=replace(spec.stats, cluster_sizes=[3, 2]))
    questions = [{"gold": ["Paris"]}, {"gold": ["Paris"]}]
    quality = draft_quality("nq", questions, [spec, two])
    assert quality == {"draft_accuracy": round(2 / 3, 4), "mean_answer_words": 2.0,
                       "one_document_cluster_rate": 0.5}
    verdicts = draft_quality("pubhealth", [{"gold": ["true"]}], [two])["draft_verdicts"]
    assert verdicts == {"None": 0.5, "false": 0.5}


def test_paired_test_counts_discordant_questions_and_pools() -> None:
    from shared_core.bench.specrag.selection import SCORE_VARIANTS, mcnemar, paired_test, pool_reports

    variant = [True, True, True, False, True, False]
    paper = [True, False, False, True, True, False]
    assert paired_test(variant, paper) == {"wins": 2, "losses": 1, "p_value": 1.0}
    assert mcnemar(0, 0)["p_value"] == 1.0
    assert mcnemar(10, 0)["p_value"] == round(2 * 0.5 ** 10, 4)  # exact two-sided binomial
    with pytest.raises(ValueError):
        paired_test([True], [True, False])  # the same questions, or no test

    def report(dataset: str, rows: list[tuple[str, str, str]]) -> dict:
        examples = [{"gold": [gold], "specrag": paper, **dict.fromkeys(SCORE_VARIANTS, other)}
                    for gold, paper, other in rows]
        return {"dataset": dataset, "n": len(rows), "examples": examples}

    nq = report("nq", [("Paris", "Paris", "Rome"), ("Paris", "Rome", "Paris"),
                       ("Oslo", "Rome", "Oslo")])
    squad = report("squad", [("1712", "1889", "1712"), ("1712", "1712", "1712")])
    pooled = pool_reports([nq, squad])
    assert pooled["questions"] == 5 and pooled["paper_score"] == 0.4
    assert pooled["datasets"] == {"nq": 3, "squad": 2}
    later = pool_reports([nq, squad], skip=1)  # the first question of each left out
    assert later["questions"] == 3 and later["datasets"] == {"nq": 2, "squad": 1}
    assert later["variants"]["drafter_only"]["wins"] == 2
    with pytest.raises(ValueError, match="none after skip=3"):
        pool_reports([nq, squad], skip=3)
    only = pooled["variants"]["drafter_only"]
    assert only == {"accuracy": 0.8, **mcnemar(3, 1)}
    del squad["examples"][0]["sel_vote"]
    with pytest.raises(ValueError, match="no 'sel_vote' answers"):
        pool_reports([nq, squad])
