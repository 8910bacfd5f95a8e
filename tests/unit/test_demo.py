"""The demo's machine line and its measured explanation of token-level speed-ups (tiny model)."""

from __future__ import annotations

from shared_core.tools.demo import explain_token_speedups, machine_line, pick_drafter, pick_verifier
from shared_core.util.device import cpu_facts
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
    from shared_core.engines.speculative_rag import SpeculativeRAGStats, StandardRAGStats
    from shared_core.tools.demo import explain_specrag

    standard = [StandardRAGStats(prompt_tokens=1500, prefill_s=8.0, decode_s=0.5, total_s=8.5)]
    fast = [SpeculativeRAGStats(draft_prefill_s=1.0, draft_decode_s=1.5, verify_s=2.0,
                                verify_tokens=400, total_s=4.6)]
    line = explain_specrag(standard, fast)
    assert line.startswith("(it pays here") and "2.5 s" in line and "2.0 s (400 tokens" in line
    assert "8.0 s for the verifier to read 1500 prompt tokens" in line
    slow = [SpeculativeRAGStats(draft_prefill_s=5.0, draft_decode_s=3.0, verify_s=2.0,
                                verify_tokens=400, total_s=10.1)]
    assert explain_specrag(standard, slow).startswith("(it does not pay here: drafting took 8.0 s")


def test_compare_answers_says_equal_or_where_they_part() -> None:
    from shared_core.tools.demo import TimedAnswer, compare_answers

    ref = TimedAnswer("Anna Kessel, 1712", [1, 2, 3, 4], 1.0, 2.0)
    assert compare_answers(ref, TimedAnswer("Anna Kessel, 1712", [1, 2, 3, 4], 0.2, 1.2)) == \
        "equal to the full prefill's (4/4 tokens)"
    line = compare_answers(ref, TimedAnswer("Anna Kessel, 1912", [1, 2, 9], 0.2, 1.2))
    assert line.startswith("DIFFERS from the full prefill's after 2 of 4 tokens")
    assert "'Anna Kessel, 1912' vs 'Anna Kessel, 1712'" in line


def test_cache_line_names_what_the_cache_did() -> None:
    from shared_core.tools.demo import cache_line

    report = {"prompt": 200, "kept": 0, "reused": 100, "computed_alone": 40, "recomputed": 15,
              "read": 60, "probe": 140, "stored": 1}
    assert cache_line(report) == ("200 prompt ids: 100 reused, 15 recomputed (15% of the reused), "
                                  "60 read, 40 read alone and stored")
    first = {"prompt": 200, "kept": 0, "reused": 0, "computed_alone": 0, "recomputed": 0,
             "read": 200, "unseen": 150, "probe": 0, "stored": 3}
    assert cache_line(first) == ("200 prompt ids: 0 reused, 0 recomputed, 200 read, 150 of them "
                                 "new passages, stored as read")
    assert cache_line(None) == "no cache report"


def test_the_demo_opens_on_the_passage_cache_then_what_does_not_pay(monkeypatch) -> None:
    """The first screen is the passage cache; token speculation and Speculative RAG come after,
    under a heading that says they do not pay here (sections stubbed: no model runs)."""
    import shared_core.retrieval
    import shared_core.runtime.models
    import shared_core.tools.demo as demo

    order: list[str] = []

    class Retriever:
        def __init__(self, embedder):
            pass

        def add(self, documents):
            pass

    class LM:
        backend, backend_reason = "llama.cpp", "stub"

    monkeypatch.setattr(shared_core.retrieval, "DenseRetriever", Retriever)
    monkeypatch.setattr(shared_core.runtime.models, "load_lm", lambda *a, **k: LM())
    monkeypatch.setattr(demo, "passage_cache_section",
                        lambda retriever, model, write: order.append("cache") or {"rows": {}})
    monkeypatch.setattr(demo, "token_engines_section",
                        lambda lm, retriever, n, write: order.append("tokens") or {})
    monkeypatch.setattr(demo, "explain_token_speedups", lambda lm, table, write: None)
    monkeypatch.setattr(demo, "speculative_rag_section",
                        lambda retriever, verifier, write, *drafter: order.append("specrag") or {})
    lines: list[str] = []
    result = demo.run_demo(write=lambda line: (lines.append(line), order.append(line)))
    assert lines[0].startswith("machine: ")
    sections = [item for item in order if item in ("cache", "tokens", "specrag")]
    assert sections == ["cache", "tokens", "specrag"]
    heading = next(i for i, item in enumerate(order) if "What does not pay here" in item)
    assert order.index("cache") < heading < order.index("tokens")
    assert set(result) == {"passage_cache", "token_engines", "speculative_rag"}


def test_passage_cache_section_says_why_it_is_skipped_without_llamacpp(monkeypatch) -> None:
    import shared_core.runtime.models
    from shared_core.tools.demo import passage_cache_section

    def refuse(*args, **kwargs):
        raise ValueError("llama.cpp is not installed")

    monkeypatch.setattr(shared_core.runtime.models, "load_lm", refuse)
    lines: list[str] = []
    assert passage_cache_section(None, "smollm2-135m-instruct", lines.append) == {}
    assert "passage KV cache" in lines[0]
    assert "skipped" in lines[1] and "llama.cpp is not installed" in lines[1]
