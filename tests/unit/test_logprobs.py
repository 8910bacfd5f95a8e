"""Log-probabilities of reply tokens (OpenAI's ``logprobs`` / ``top_logprobs``): the model's own
distribution at each position, equal for every lossless engine, in both adapters' formats."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from langchain_core.messages import HumanMessage
from llama_index.core.base.llms.types import ChatMessage, MessageRole

from langchain_specrag import ChatSpeculative
from llamaindex_specrag import SpeculativeLLM
from shared_core.decoding.output import generation_config
from shared_core.engines.registry import start_engine

PROMPT = "alpha beta gamma delta alpha beta gamma"
DOCUMENTS = ["alpha beta gamma delta epsilon alpha beta gamma delta epsilon zeta"]
MESSAGES = [{"role": "user", "content": PROMPT}]


def _by_hand(lm: Any, prompt_ids: list[int], reply: list[int]) -> torch.Tensor:
    """``[len(reply), V]`` log-probabilities from one full forward over prompt and reply."""
    ids = torch.tensor([prompt_ids + reply])
    with torch.no_grad():
        logits = lm.model(ids).logits[0, len(prompt_ids) - 1: -1]
    return torch.log_softmax(logits[:, : len(lm.tokenizer)].float(), dim=-1)


def _run(lm: Any, engine: str, top: int | None, **options: Any) -> Any:
    generation = generation_config(8, top_logprobs=top)
    return start_engine(engine, lm, MESSAGES, generation, documents=DOCUMENTS, **options).run()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_token_gets_its_log_probability_and_the_most_likely_alternatives(
        tiny_target: Any, temperature: float) -> None:
    generation = generation_config(8, top_logprobs=3, temperature=temperature, seed=5)
    result = start_engine("autoregressive", tiny_target, MESSAGES, generation).run()
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids) > 0
    expected = _by_hand(tiny_target, tiny_target.prompt_ids(MESSAGES), result.token_ids)
    for i, (entry, token) in enumerate(zip(result.logprobs, result.token_ids, strict=True)):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(expected[i, token].item(), abs=1e-4)
        values, ids = expected[i].topk(3)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
        if temperature == 0:  # greedy takes the most likely token
            assert entry.top[0] == (token, pytest.approx(entry.logprob))


def test_no_log_probabilities_unless_asked_and_top_zero_gives_the_token_only(
        tiny_target: Any) -> None:
    assert _run(tiny_target, "autoregressive", None).logprobs is None
    entries = _run(tiny_target, "autoregressive", 0).logprobs
    assert entries and all(e.top == () for e in entries)


def _same(ours: list[Any], reference: list[Any]) -> None:
    assert [e.token_id for e in ours] == [e.token_id for e in reference]
    for mine, theirs in zip(ours, reference, strict=True):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]


def test_respec_reports_what_plain_decoding_reports(tiny_target: Any) -> None:
    plain = _run(tiny_target, "autoregressive", 2)
    # a document holding the reply: its drafts are accepted, several tokens a round
    document = [*tiny_target.prompt_ids(MESSAGES)[-4:], *plain.token_ids]
    generation = generation_config(8, top_logprobs=2)
    respec = start_engine("respec", tiny_target, MESSAGES, generation, documents=[document],
                          use_trigger=False).run()
    assert respec.stats.accepted > 0
    assert plain.logprobs is not None and respec.logprobs is not None
    _same(respec.logprobs, plain.logprobs)


def test_rapid_at_eta_0_reports_what_long_context_decoding_reports(tiny_target: Any) -> None:
    rapid = _run(tiny_target, "rapid", 2, gamma=3, eta=0.0)
    reference = _run(tiny_target, "rapid", 2, method="long_context")
    assert rapid.stats.accepted > 0
    assert rapid.logprobs is not None and reference.logprobs is not None
    _same(rapid.logprobs, reference.logprobs)


def test_both_adapters_report_them_in_their_frameworks_form(tiny_target: Any) -> None:
    chat = ChatSpeculative(lm=tiny_target, model="tiny", max_tokens=6, engine="autoregressive")
    llm = SpeculativeLLM(tiny_target, model="tiny", max_new_tokens=6, engine="autoregressive")
    reference = _run(tiny_target, "autoregressive", 2)
    message = chat.invoke([HumanMessage(PROMPT)], logprobs=True, top_logprobs=2)
    content = message.response_metadata["logprobs"]["content"]
    assert [e["logprob"] for e in content] == pytest.approx(
        [e.logprob for e in reference.logprobs[:6]], abs=1e-4)
    assert all(len(e["top_logprobs"]) == 2 and e["token"] == tiny_target.decode([t.token_id])
               for e, t in zip(content, reference.logprobs, strict=False))
    chunks = list(chat.stream([HumanMessage(PROMPT)], logprobs=True, top_logprobs=2))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    assert streamed.response_metadata["logprobs"] == message.response_metadata["logprobs"]
    assert "logprobs" not in chat.invoke([HumanMessage(PROMPT)]).response_metadata
    response = llm.chat([ChatMessage(role=MessageRole.USER, content=PROMPT)], top_logprobs=2)
    assert response.logprobs is not None and len(response.logprobs) == len(content)
    assert [[p.token for p in position] for position in response.logprobs] == \
        [[t["token"] for t in e["top_logprobs"]] for e in content]
    only = llm.complete(PROMPT, logprobs=True).logprobs
    assert only is not None and all(len(position) == 1 for position in only)
    assert llm.chat([ChatMessage(role=MessageRole.USER, content=PROMPT)]).logprobs is None


@pytest.mark.parametrize(("settings", "error", "match"), [
    ({"top_logprobs": 21}, ValueError, "top_logprobs must be at most 20"),
    ({"top_logprobs": -1}, ValueError, "top_logprobs"),
    ({"top_logprobs": 1.5}, TypeError, "top_logprobs"),
    ({"logprobs": "yes"}, TypeError, "logprobs must be a bool"),
    ({"logprobs": False, "top_logprobs": 2}, ValueError, "top_logprobs=2 needs logprobs=True"),
])
def test_bad_settings_are_refused_naming_them(tiny_target: Any, settings: dict[str, Any],
                                              error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ChatSpeculative(lm=tiny_target, **settings)
    with pytest.raises(error, match=match):
        SpeculativeLLM(tiny_target, **settings)
    chat = ChatSpeculative(lm=tiny_target, max_tokens=2)
    with pytest.raises(error, match=match):
        chat.invoke([HumanMessage(PROMPT)], **settings)
