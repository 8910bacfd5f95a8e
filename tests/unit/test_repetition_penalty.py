"""llama.cpp's penalties (``repeat_penalty`` / ``repeat_last_n`` / ``frequency_penalty`` /
``presence_penalty``) as a logits mask: the mask itself, and plain and speculative decoding
behind both chat adapters equal to penalised greedy decoding computed here independently (full
forwards, the penalties applied by hand)."""

from __future__ import annotations

import pytest
import torch
from langchain_core.messages import HumanMessage
from llama_index.core.base.llms.types import ChatMessage, MessageRole

from langchain_specrag.chat_models.speculative import ChatSpeculative
from llamaindex_specrag.llms.speculative import SpeculativeLLM
from shared_core.config import PenaltyConfig
from shared_core.decoding.penalty import RepetitionPenalty

QUESTION = "0 1 2 3 4 5 6 7 0 1 2 3"
N_NEW = 24


def _by_hand(lm, ids: list[int], penalties: dict, n_new: int) -> list[int]:
    """Greedy decoding with a full forward per token; each token seen ``c`` times among the last
    ``repeat_last_n`` ids has its logit divided by ``repeat_penalty`` (multiplied where negative),
    then ``c * frequency_penalty + presence_penalty`` subtracted."""
    config = PenaltyConfig(**penalties)
    out: list[int] = []
    for _ in range(n_new):
        with torch.no_grad():
            logits = lm.model(torch.tensor([ids + out])).logits[0, -1].float()
        window = (ids + out)[-config.repeat_last_n:]
        for token in set(window):
            value = logits[token]
            value = value / config.repeat_penalty if value > 0 else value * config.repeat_penalty
            shift = torch.tensor(window.count(token), dtype=torch.float32) * (
                config.frequency_penalty) + config.presence_penalty
            logits[token] = value - shift
        out.append(int(logits.argmax()))
        if out[-1] in lm.eos_token_ids:
            break
    return out


def test_the_mask_penalises_each_rows_own_window() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 4.0]] * 3)
    mask = RepetitionPenalty(PenaltyConfig(2.0, 2), history=[3, 0, 1])  # window: [0, 1]
    out = mask.mask(logits, drafted=[2, 3])
    assert out[0].tolist() == [1.0, -4.0, 1.0, 4.0]  # after [0, 1]
    assert out[1].tolist() == [2.0, -4.0, 0.5, 4.0]  # after [1, 2]
    assert out[2].tolist() == [2.0, -2.0, 0.5, 2.0]  # after [2, 3]
    assert torch.equal(logits, torch.tensor([[2.0, -2.0, 1.0, 4.0]] * 3))  # not in place
    mask.commit([2])
    assert mask.mask(logits[:1], [])[0].tolist() == [2.0, -4.0, 0.5, 4.0]


def test_frequency_and_presence_subtract_per_count_and_per_token() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 4.0]] * 3)
    config = PenaltyConfig(1.0, 3, frequency_penalty=0.5, presence_penalty=0.25)
    out = RepetitionPenalty(config, history=[0, 0, 1]).mask(logits, drafted=[0, 3])
    assert out[0].tolist() == [0.75, -2.75, 1.0, 4.0]  # after [0, 0, 1]: 0 twice, 1 once
    assert out[1].tolist() == [0.75, -2.75, 1.0, 4.0]  # after [0, 1, 0]
    assert out[2].tolist() == [1.25, -2.75, 1.0, 3.25]  # after [1, 0, 3]
    both = PenaltyConfig(2.0, 2, frequency_penalty=1.0, presence_penalty=0.0)
    assert RepetitionPenalty(both, [1, 1]).mask(logits[:1], [])[0].tolist() == (
        [2.0, -6.0, 1.0, 4.0])  # -2 * 2 (repeat), then - 2 * 1.0 (twice seen)


def test_rows_beyond_the_drafts_and_an_empty_window_are_left_as_they_are() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 4.0]] * 3)
    config = PenaltyConfig(2.0, 4, presence_penalty=1.0)
    assert torch.equal(RepetitionPenalty(config, []).mask(logits[:1], []), logits[:1])
    out = RepetitionPenalty(config, []).mask(logits, drafted=[3])  # rows: after [], after [3]
    assert out[0].tolist() == [2.0, -2.0, 1.0, 4.0]
    assert out[1].tolist() == [2.0, -2.0, 1.0, 1.0]
    assert out[2].tolist() == [2.0, -2.0, 1.0, 4.0]  # no draft scores this row


@pytest.mark.parametrize("bad", [{"repeat_penalty": 0}, {"repeat_penalty": "1.1"},
                                 {"repeat_last_n": -1}, {"repeat_penalty": float("nan")},
                                 {"frequency_penalty": "0.5"}, {"presence_penalty": float("inf")},
                                 {"frequency_penalty": True}])
def test_bad_settings_are_refused_naming_them(tiny_target, bad) -> None:
    name = next(iter(bad))
    with pytest.raises((TypeError, ValueError), match=name):
        ChatSpeculative(lm=tiny_target, **bad)
    with pytest.raises((TypeError, ValueError), match=name):
        SpeculativeLLM(tiny_target, **bad)
    with pytest.raises((TypeError, ValueError), match=name):
        ChatSpeculative(lm=tiny_target).invoke(QUESTION, **bad)


PENALTIES = {"repeat": {"repeat_penalty": 1.8, "repeat_last_n": 16},
             "frequency and presence": {"repeat_last_n": 16, "frequency_penalty": 1.5,
                                        "presence_penalty": 0.5},
             "all three": {"repeat_penalty": 1.3, "repeat_last_n": 16, "frequency_penalty": 0.7,
                           "presence_penalty": 0.3}}


@pytest.mark.parametrize("penalties", PENALTIES.values(), ids=PENALTIES.keys())
@pytest.mark.parametrize("engine", ["autoregressive", "respec"])
def test_the_engines_equal_penalised_greedy_in_both_adapters(tiny_target, engine,
                                                             penalties) -> None:
    """(RAPID's target reads a long context the messages do not hold; its window is the
    messages' and the reply's ids, so no by-hand reference is written for it here.)"""
    prompt = tiny_target.prompt_ids([{"role": "user", "content": QUESTION}])
    penalised = _by_hand(tiny_target, prompt, penalties, N_NEW)
    plain = _by_hand(tiny_target, prompt, {}, N_NEW)
    assert penalised != plain  # the penalty changes this reply
    # ReSpec drafts from both replies: the penalised one's drafts are accepted, the plain one's
    # are rejected where the two part
    documents = [tiny_target.decode(prompt[-3:] + reply) for reply in (penalised, plain)]
    options = ({"engine_options": {"measure_cost": False, "use_trigger": False},
                "documents": documents}
               if engine == "respec" else {})
    settings = {"model": "tiny", "engine": engine, **penalties, **options}
    chat = ChatSpeculative(lm=tiny_target, max_tokens=N_NEW, **settings)
    llm = SpeculativeLLM(tiny_target, max_new_tokens=N_NEW, **settings)
    message = chat.invoke([HumanMessage(QUESTION)])
    response = llm.chat([ChatMessage(role=MessageRole.USER, content=QUESTION)])
    stats = message.response_metadata["speculative_stats"]
    assert stats["new_tokens"] == len(penalised)
    assert message.content == response.message.content == tiny_target.decode(penalised)
    if engine == "respec":
        assert stats["accepted"] > 0 and stats["drafted"] > stats["accepted"]
    off = dict.fromkeys(("frequency_penalty", "presence_penalty"), 0.0)
    assert chat.invoke([HumanMessage(QUESTION)], repeat_penalty=1.0, **off).content == (
        tiny_target.decode(plain))
