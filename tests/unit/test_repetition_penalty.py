"""llama.cpp's repetition penalty (``repeat_penalty`` / ``repeat_last_n``) as a logits mask: the
mask itself, and plain and speculative decoding behind both chat adapters equal to penalised
greedy decoding computed here independently (full forwards, the penalty applied by hand)."""

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


def _by_hand(lm, ids: list[int], penalty: float, last_n: int, n_new: int) -> list[int]:
    """Greedy decoding with a full forward per token, each logit of the last ``last_n`` ids'
    distinct tokens divided by ``penalty`` (multiplied where negative)."""
    out: list[int] = []
    for _ in range(n_new):
        with torch.no_grad():
            logits = lm.model(torch.tensor([ids + out])).logits[0, -1].float()
        for token in set((ids + out)[-last_n:]):
            value = logits[token]
            logits[token] = value / penalty if value > 0 else value * penalty
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


@pytest.mark.parametrize("bad", [{"repeat_penalty": 0}, {"repeat_penalty": "1.1"},
                                 {"repeat_last_n": -1}, {"repeat_penalty": float("nan")}])
def test_bad_settings_are_refused_naming_them(tiny_target, bad) -> None:
    name = next(iter(bad))
    with pytest.raises((TypeError, ValueError), match=name):
        ChatSpeculative(lm=tiny_target, **bad)
    with pytest.raises((TypeError, ValueError), match=name):
        SpeculativeLLM(tiny_target, **bad)
    with pytest.raises((TypeError, ValueError), match=name):
        ChatSpeculative(lm=tiny_target).invoke(QUESTION, **bad)


@pytest.mark.parametrize("engine", ["autoregressive", "respec"])
def test_the_engines_equal_penalised_greedy_in_both_adapters(tiny_target, engine) -> None:
    """(RAPID's target reads a long context the messages do not hold; its window is the
    messages' and the reply's ids, so no by-hand reference is written for it here.)"""
    prompt = tiny_target.prompt_ids([{"role": "user", "content": QUESTION}])
    penalised = _by_hand(tiny_target, prompt, 1.8, 16, N_NEW)
    plain = _by_hand(tiny_target, prompt, 1.0, 16, N_NEW)
    assert penalised != plain  # the penalty changes this reply
    # ReSpec drafts from both replies: the penalised one's drafts are accepted, the plain one's
    # are rejected where the two part
    documents = [tiny_target.decode(prompt[-3:] + reply) for reply in (penalised, plain)]
    options = ({"engine_options": {"measure_cost": False, "use_trigger": False},
                "documents": documents}
               if engine == "respec" else {})
    settings = {"model": "tiny", "engine": engine, "repeat_penalty": 1.8, "repeat_last_n": 16,
                **options}
    chat = ChatSpeculative(lm=tiny_target, max_tokens=N_NEW, **settings)
    llm = SpeculativeLLM(tiny_target, max_new_tokens=N_NEW, **settings)
    message = chat.invoke([HumanMessage(QUESTION)])
    response = llm.chat([ChatMessage(role=MessageRole.USER, content=QUESTION)])
    stats = message.response_metadata["speculative_stats"]
    assert stats["new_tokens"] == len(penalised)
    assert message.content == response.message.content == tiny_target.decode(penalised)
    if engine == "respec":
        assert stats["accepted"] > 0 and stats["drafted"] > stats["accepted"]
    assert chat.invoke([HumanMessage(QUESTION)], repeat_penalty=1.0).content == (
        tiny_target.decode(plain))
