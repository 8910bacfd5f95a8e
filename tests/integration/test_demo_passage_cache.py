"""The demo's first screen with the embedded SmolLM2 on llama.cpp: the passage cache section
names the contract, answers the second question (its passages overlap the first's in another
order) with a full prefill and through the cache, reports what the cache reused and compares
the answers. Structure and counts only: no timing is asserted."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from shared_core.retrieval import Document
from shared_core.tools.demo import CACHE_QUESTIONS, KNOWLEDGE_BASE, passage_cache_section
from tests.tiny import require_llamacpp_smollm2

pytestmark = pytest.mark.integration

require_llamacpp_smollm2()

# the demo's retrieval with MiniLM, fixed here so the test does not depend on the embedder
TOP = {CACHE_QUESTIONS[0]: ["harbor", "railway", "school", "library"],
       CACHE_QUESTIONS[1]: ["railway", "harbor", "school", "bridge"]}


@dataclass
class Hit:
    document: Document


class FixedRetriever:
    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        return [[Hit(Document(key, KNOWLEDGE_BASE[key])) for key in TOP[q][:k]] for q in queries]


def test_first_screen_shows_the_cache_the_contract_and_the_compared_answers(monkeypatch) -> None:
    monkeypatch.setenv("SPECRAG_NUM_THREADS", "1")  # the exact contract's condition
    lines: list[str] = []
    result = passage_cache_section(FixedRetriever(), "smollm2-135m-instruct", lines.append,
                                   max_new_tokens=8)
    text = "\n".join(lines)
    assert "passage KV cache" in lines[0] and "llama.cpp" in lines[0]
    # Q1 cold, then again through the exact contract; then Q2 through the blend contract
    order = [f"Q1: {CACHE_QUESTIONS[0]}", "contract exact", f"Q2: {CACHE_QUESTIONS[1]}",
             "contract blend", "with the cache", "On this machine: "]
    positions = [text.index(marker) for marker in order]
    assert positions == sorted(positions)
    assert "3 of Q1's 4, in another order" in text
    assert text.count("full prefill    TTFT") == 2
    assert "answer equal to the cold one token for token" in text  # exact: the contract holds
    compared = [line for line in lines if line.startswith("   answer ") and "cold one" not in line]
    assert len(compared) == 1 and compared[0].startswith(
        ("   answer equal to the full prefill's", "   answer DIFFERS"))  # blend: as measured
    summary = lines[-1]
    assert "exact reuse gave Q1's first token" in summary and "token-identical: True" in summary
    assert "answer equal to the full prefill's: " in summary
    rows, exact = result["rows"], result["exact"]
    assert exact["cold"].cache["reused"] == 0 and exact["warm"].cache["reused"] > 0
    assert exact["equal"] and exact["warm"].token_ids == exact["cold"].token_ids
    assert rows["Q1"]["cached"].cache["reused"] == 0  # nothing stored yet
    q1 = rows["Q1"]["cached"].cache  # new passages read in context and stored as read
    assert q1["computed_alone"] == 0 and q1["unseen"] > 0 and q1["stored"] >= 1
    assert rows["Q2"]["cached"].cache["reused"] > 0  # Q1's passages, found in another order
    assert rows["Q2"]["equal"] == (rows["Q2"]["cached"].token_ids == rows["Q2"]["full"].token_ids)
    assert result["ttft_speedup"] > 0


def test_on_a_model_blend_refuses_the_section_runs_exact_and_says_why(monkeypatch) -> None:
    """Gemma-3 (the verifier without the `qwen` extra) has sliding-window layers: loading it
    with blend is refused naming passage_cache, and the demo shows the exact contract and why
    blend is skipped (before: a StateFormatError ended the demo)."""
    from shared_core.runtime.models import load_lm
    from shared_core.runtime.weights.embedded import is_installed

    if not is_installed("gemma-3-270m"):
        pytest.skip("the Gemma part packages")
    with pytest.raises(ValueError, match=r"passage_cache='blend' cannot run.*sliding-window.*"
                                         r"passage_cache='exact'"):
        load_lm("gemma-3-270m", backend="llama.cpp", n_ctx=512, passage_cache="blend")
    monkeypatch.setenv("SPECRAG_NUM_THREADS", "1")
    lines: list[str] = []
    result = passage_cache_section(FixedRetriever(), "gemma-3-270m", lines.append,
                                   max_new_tokens=4)
    text = "\n".join(lines)
    assert "contract exact" in text and "contract blend skipped: " in text
    assert "sliding-window" in text and "Q2:" not in text
    assert result["exact"]["equal"] and set(result["rows"]) == {"Q1"}
