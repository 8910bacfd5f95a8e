"""The demo's machine line and its measured explanation of token-level speed-ups (tiny model)."""

from __future__ import annotations

from shared_core.demo import explain_token_speedups, machine_line, pick_verifier
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
