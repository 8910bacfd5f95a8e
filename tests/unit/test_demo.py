"""The demo's machine line and its measured explanation of token-level speed-ups (tiny model)."""

from __future__ import annotations

from shared_core.demo import explain_token_speedups, machine_line, pick_drafter, pick_verifier
from shared_core.device import cpu_facts
from tests.tiny import tiny_lm


def test_machine_line_names_cpu_flags_threads_and_load():
    facts = cpu_facts()
    line = machine_line(facts)
    assert facts["cpu"] in line and f"{facts['threads']} threads" in line
    assert "load average" in line and "OMP_WAIT_POLICY" in line


def test_explanation_is_measured_and_only_blames_speculation_where_it_lost():
    lines: list[str] = []
    lm = tiny_lm(2, seed=0)
    explain_token_speedups(lm, {"autoregressive": {"speedup": 1.0}, "respec": {"speedup": 1.2}},
                           lines.append)
    assert len(lines) == 1 and "4-token verification forward costs" in lines[0]
    explain_token_speedups(lm, {"autoregressive": {"speedup": 1.0}, "respec": {"speedup": 0.8}},
                           lines.append)
    assert len(lines) == 3 and "below 1x" in lines[2]


def test_verifier_is_a_known_alias():
    assert pick_verifier() in ("qwen2.5-coder-1.5b-instruct", "gemma-3-270m")


def test_drafter_pairs_with_the_verifier():
    """The 0.5B drafts answer-first beside the 1.5B (one extra installs both); else SmolLM2."""
    drafter, order = pick_drafter()
    if pick_verifier() == "qwen2.5-coder-1.5b-instruct":
        assert (drafter, order) == ("qwen2.5-coder-0.5b-instruct", "answer_first")
    else:
        assert (drafter, order) == ("smollm2-135m-instruct", "answer_first")  # the default


def test_explain_specrag_names_the_measured_parts() -> None:
    from shared_core.demo import explain_specrag
    from shared_core.engines.speculative_rag import SpeculativeRAGStats, StandardRAGStats

    standard = [StandardRAGStats(prompt_tokens=1500, prefill_s=8.0, decode_s=0.5, total_s=8.5)]
    fast = [SpeculativeRAGStats(draft_prefill_s=1.0, draft_decode_s=1.5, verify_s=2.0,
                                verify_tokens=400, total_s=4.6)]
    line = explain_specrag(standard, fast)
    assert line.startswith("(it pays here") and "2.5 s" in line and "2.0 s (400 tokens" in line
    assert "8.0 s for the verifier to read 1500 prompt tokens" in line
    slow = [SpeculativeRAGStats(draft_prefill_s=5.0, draft_decode_s=3.0, verify_s=2.0,
                                verify_tokens=400, total_s=10.1)]
    assert explain_specrag(standard, slow).startswith("(it does not pay here: drafting took 8.0 s")
