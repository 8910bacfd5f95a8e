"""``python -m shared_core.bench chat``'s real conversations: MT-Bench turns in order, the agent
transcript of examples/agents.py, each follow-up prompt extending the previous prompt and reply
(so the prefix cache can serve it), and the per-turn rows, medians and plot (tiny torch model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny import measured, tiny_lm

from shared_core.bench.__main__ import build_parser
from shared_core.bench.chat.sources import agent_transcript, keyword_search, mt_bench, prompts
from shared_core.bench.chat.turns import conversation_rows, medians, plot_turns

ROWS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a poem.", "Make it shorter."]},
    {"question_id": 2, "category": "writing", "turns": ["Write a story.", "Add a title."]},
    {"question_id": 3, "category": "math", "turns": ["What is 2 + 2?", "And times 3?"]},
]
CALL = '{"name": "search_handbook", "arguments": {"query": "paid vacation days"}}\n</tool_call>'


@pytest.fixture(scope="module")
def lm():
    return tiny_lm()


@pytest.fixture
def data(tmp_path: Path) -> Path:
    (tmp_path / "mt_bench").mkdir()
    lines = "\n".join(json.dumps(r) for r in ROWS)
    (tmp_path / "mt_bench" / "question.jsonl").write_text(lines + "\n", encoding="utf-8")
    return tmp_path


def test_mt_bench_rows_round_robin_over_categories_with_turns_in_order(data: Path) -> None:
    conversations = mt_bench(data, 3)
    assert [c.name for c in conversations] == ["1 writing", "3 math", "2 writing"]
    first = conversations[0]
    assert first.opening == [{"role": "user", "content": "Write a poem."}]
    assert first.user_turns == ["Make it shorter."]
    assert len(mt_bench(data, 1)) == 1


def test_each_mt_bench_prompt_starts_with_the_previous_prompt_and_reply(lm, data: Path) -> None:
    conversation = mt_bench(data, 1)[0]
    first, second = prompts(conversation, lm, ["Roses are red.", "Red roses."])
    reply = lm.encode("Roses are red.")
    assert second[: len(first) + len(reply)] == first + reply
    text = lm.tokenizer.decode(second)
    assert text.index("Write a poem.") < text.index("Roses are red.") < text.index("Make it")


def test_mt_bench_conversation_ends_after_its_last_user_turn(lm, data: Path) -> None:
    conversation = mt_bench(data, 1)[0]
    assert len(prompts(conversation, lm, ["a", "b", "c", "d"])) == 2


def test_agent_transcript_reads_the_example_and_answers_the_call_with_passages(lm) -> None:
    conversation = agent_transcript()
    assert conversation.opening[0]["role"] == "system"
    assert "Veldmark" in conversation.opening[1]["content"]
    assert [t["function"]["name"] for t in conversation.tools] == ["search_handbook"]
    first, second = prompts(conversation, lm, [CALL, "They get 27 days."])
    assert second[: len(first)] == first  # the forced <tool_call> prefill is kept
    text = lm.tokenizer.decode(second)
    assert "paid vacation days" in text and "27 days of paid vacation" in text
    assert not conversation.notes


def test_agent_transcript_goes_on_while_the_model_calls(lm) -> None:
    conversation = agent_transcript()
    assert len(prompts(conversation, lm, [CALL, "<tool_call>\n" + CALL, "27.", "x"])) == 3


def test_a_forced_call_the_model_did_not_finish_searches_the_question(lm) -> None:
    conversation = agent_transcript()
    _, second = prompts(conversation, lm, ['{"name": "search_hand', "27."])
    assert len(conversation.notes) == 1
    assert "27 days of paid vacation" in lm.tokenizer.decode(second)


def test_keyword_search_ranks_by_shared_words_then_file_order() -> None:
    search = keyword_search(["a b c", "x y", "b c d"], k=2)
    assert search("c d") == "b c d\na b c"


def test_rows_medians_and_plot_on_a_tiny_model(lm, data: Path, tmp_path: Path) -> None:
    rows = [{"model": "tiny", **row}
            for conv in mt_bench(data, 2) for row in conversation_rows(lm, conv, 4, 2)]
    assert [(r["conversation"], r["turn"]) for r in rows] == [("1 writing", 2), ("3 math", 2)]
    for row in rows:
        assert row["prompt_tokens"] > row["reused_tokens"] == row["reused_tokens_off"] == 0
        assert measured(row["ttft_off_s"], row["ttft_on_s"], row["total_off_s"], row["total_on_s"])
        assert isinstance(row["identical"], bool)
    summary = medians(rows)["tiny"]["mt_bench"]
    assert summary["turns"] == 2 and summary["identical"].endswith("/2")
    report = {"turns": rows, "max_new_tokens": 4, "load_average": {"after": (1.0, 1.0, 1.0)}}
    plot_turns(report, str(tmp_path / "chat.png"))
    assert (tmp_path / "chat.png").read_bytes()[:4] == b"\x89PNG"


def test_sources_are_checked_by_the_parser() -> None:
    args = build_parser().parse_args(["chat", "--sources", "agent", "--conversations", "2"])
    assert args.sources == ["agent"] and args.conversations == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "--sources", "chatbot_arena"])


def test_lm_threads_reads_the_runtime_then_torch() -> None:
    from types import SimpleNamespace

    import torch

    from shared_core.bench.common import lm_threads

    assert lm_threads(SimpleNamespace(model=SimpleNamespace(threads=3))) == 3  # llama.cpp's own
    assert lm_threads(SimpleNamespace(model=object())) == torch.get_num_threads()
