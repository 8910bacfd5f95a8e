"""llama.cpp models beyond plain attention, on real llama.cpp with tiny GGUFs of their
architectures (:mod:`tests.tiny_gguf`): an architecture transformers does not know loads with its
GGUF's own tokenizer; multi-axis rotary positions (M-RoPE) refuse a blend passage cache, whose
passages move; a recurrent state (Mamba; hybrids such as Qwen3.5 alike) refuses the engines that
roll drafts back, rolls back correctly by reading again, and keeps its state for a next turn; a
vocabulary transformers splits otherwise is read by llama.cpp's own tokenizer."""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from shared_core.drafters.model import ModelDrafter
from shared_core.drafters.prompt_lookup import PromptLookupDrafter
from shared_core.engines.baseline import autoregressive_generate, speculative_generate
from shared_core.engines.respec.engine import ReSpecDecoder
from shared_core.runtime.lm import clear_prefix_cache
from shared_core.runtime.models import load_lm
from tests.tiny import require_llamacpp_smollm2
from tests.tiny_gguf import ARCHITECTURES, write_tiny_gguf

pytestmark = pytest.mark.integration

require_llamacpp_smollm2()

TEXT = "The weir on the river Ouse was built by the miller Tom Hale in 1802, naïve café 東京."
# (recurrent, shiftable) as llama.cpp's own flags say of each architecture
EXPECTED = {"qwen2": (False, True), "qwen2vl": (False, False), "mamba": (True, False)}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tiny_gguf")
    return {arch: write_tiny_gguf(arch, folder) for arch in ARCHITECTURES}


def _load(path: Path, **settings: Any) -> Any:
    return load_lm(str(path), backend="llama.cpp", n_ctx=512, **settings)


@pytest.fixture(scope="module")
def mamba(ggufs: dict[str, Path]) -> Any:
    return _load(ggufs["mamba"])


def _ids(lm: Any) -> list[int]:
    return [int(t) for t in lm.tokenizer.encode(TEXT)]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_memory_flags_are_llama_cpps_own(ggufs: dict[str, Path], arch: str) -> None:
    lm = _load(ggufs[arch])
    model, llama = lm.model, lm.model.llama
    assert model.recurrent == bool(llama.llama_model_is_recurrent(model.ptr)
                                   or llama.llama_model_is_hybrid(model.ptr))
    session = lm.open_session()
    session.prefill(_ids(lm)[:4])
    can_shift = bool(llama.llama_memory_can_shift(session.slot.memory))
    assert model.can_shift == (can_shift and not model.recurrent)
    assert (model.recurrent, model.can_shift) == EXPECTED[arch]
    caps = lm.capabilities
    assert (caps.rollback, caps.position_shift) == (not model.recurrent, model.can_shift)


def test_an_architecture_transformers_does_not_know_runs_with_its_gguf_tokenizer(
        ggufs: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match="architecture"):  # why the fallback exists
        AutoTokenizer.from_pretrained(ggufs["qwen2vl"].parent, gguf_file=ggufs["qwen2vl"].name)
    lm = _load(ggufs["qwen2vl"])
    assert _ids(lm) == lm.model.tokenize(TEXT)
    reference = _load(ggufs["qwen2"])  # the same vocabulary, read by AutoTokenizer
    messages = [{"role": "user", "content": TEXT}]
    assert (lm.tokenizer.apply_chat_template(messages, tokenize=False)
            == reference.tokenizer.apply_chat_template(messages, tokenize=False))
    result = autoregressive_generate(lm, messages, 6)
    assert len(result.token_ids) == 6


def test_a_vocabulary_transformers_splits_otherwise_is_read_as_llama_cpp_reads_it(
        ggufs: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    """transformers has no split regex for some llama.cpp vocabularies ("deepseek-llm" here) and
    falls back to GPT-2's, which splits digits and CJK otherwise: prompts, chat prompts and
    offsets come from llama.cpp's own tokenizer, and the load says the two differ."""
    other = write_tiny_gguf("qwen2", ggufs["qwen2"].parent, pre="deepseek-llm")
    with caplog.at_level(logging.INFO, logger="shared_core.runtime.models"):
        lm = _load(other)
        _load(ggufs["qwen2vl"])
    noted = [r.getMessage() for r in caplog.records if "splits text unlike" in r.getMessage()]
    assert len(noted) == 1 and noted[0].startswith(other.name)
    assert _ids(lm) != lm.model.tokenize(TEXT)  # transformers' reading differs here
    assert lm.encode(TEXT) == lm.model.tokenize(TEXT)
    messages = [{"role": "user", "content": TEXT}]
    rendered = lm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert lm.prompt_ids(messages) == lm.model.tokenize(rendered)
    ids, starts = lm.encode_offsets(TEXT)  # equal to transformers' where both agree: test_llamacpp
    assert ids == lm.encode(TEXT) and starts is not None and len(starts) == len(ids)
    assert starts[0] == 0 and starts == sorted(starts) and starts[-1] == len(TEXT) - 1
    result = autoregressive_generate(lm, messages, 4)
    assert len(result.token_ids) == 4


def test_blend_is_refused_where_positions_cannot_shift_and_exact_reuses_blocks(
        ggufs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECRAG_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=r"passage_cache='blend'.*M-RoPE.*passage_cache='exact'"):
        _load(ggufs["qwen2vl"], passage_cache="blend")
    lm = _load(ggufs["qwen2vl"], passage_cache="exact")
    ids = _ids(lm) * 6  # several exact blocks
    first = lm.open_session().prefill(ids)
    gc.collect()
    clear_prefix_cache(lm)
    session = lm.open_session()
    again = session.prefill(ids)
    report = session.passage_report
    assert report is not None and report.reused > 0
    assert first is not None and again is not None and int(first.argmax()) == int(again.argmax())


def test_a_recurrent_model_refuses_what_rolls_drafts_back(mamba: Any, ggufs: dict[str, Path]
                                                          ) -> None:
    prompt = [{"role": "user", "content": TEXT}]
    with pytest.raises(ValueError, match=r"^speculative decoding .* recurrent state"):
        speculative_generate(mamba, PromptLookupDrafter(), prompt, 8)
    with pytest.raises(ValueError, match=r"^ReSpec .* recurrent state"):
        ReSpecDecoder(mamba).generate(prompt, 8)
    with pytest.raises(ValueError, match=r"^a draft model .* recurrent state"):
        ModelDrafter(mamba, target=_load(ggufs["qwen2"]))
    with pytest.raises(ValueError, match=r"^passage_cache='exact' .* recurrent state"):
        _load(ggufs["mamba"], passage_cache="exact")
    with pytest.raises(ValueError, match=r"^extend_tree .* recurrent state"):
        mamba.open_session().extend_tree([1, 2], [-1, -1])
    source = mamba.open_session()
    source.prefill(_ids(mamba)[:6])
    with pytest.raises(ValueError, match=r"^copy_positions .* recurrent state"):
        mamba.open_session().copy_positions(source, [0, 5])
    assert len(autoregressive_generate(mamba, prompt, 6).token_ids) == 6  # plain decoding runs


def _next_logits(session: Any, token: int) -> torch.Tensor:
    logits: torch.Tensor = session.extend([token])[-1]
    return logits


def test_a_recurrent_session_rolls_back_by_reading_again(mamba: Any) -> None:
    """llama.cpp cannot cut a recurrent state (its ``seq_rm`` refuses, even for the last position
    alone): a rollback reads the kept ids again, so the next token sees exactly the state after
    them."""
    ids = _ids(mamba)
    clear_prefix_cache(mamba)
    straight = mamba.open_session()
    straight.prefill(ids)
    expected = _next_logits(straight, 42)
    for drop in (1, 5):  # the last position alone, and several
        session = mamba.open_session()
        session.prefill(ids)
        session.extend([7, 8, 9, 10, 11][:drop])
        session.rollback(len(ids))
        assert session.tokens == ids
        torch.testing.assert_close(_next_logits(session, 42), expected, rtol=0, atol=1e-4)
    session = mamba.open_session()
    session.prefill(ids)
    assert session.sync([*ids[:-3], 5]) == [5]  # sync rolls back through the same path
    cold = mamba.open_session()
    cold.prefill(ids[:-3])
    torch.testing.assert_close(_next_logits(session, 5), _next_logits(cold, 5), rtol=0, atol=1e-4)


def test_a_recurrent_models_next_turn_reuses_its_state(mamba: Any,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A released context keeps the state after its ids; a prompt extending all of them reads
    only the rest (a chat's next turn), one that does not starts cold, and neither is a
    disagreement worth a warning."""
    ids = _ids(mamba)
    follow_up = [*ids, 11, 12, 13]
    clear_prefix_cache(mamba)
    cold = mamba.open_session()
    expected = cold.prefill(follow_up)
    del cold
    gc.collect()
    clear_prefix_cache(mamba)
    with caplog.at_level(logging.WARNING):
        first = mamba.open_session()
        first.prefill(ids)
        del first
        gc.collect()
        turn = mamba.open_session()
        logits = turn.prefill(follow_up)
        assert turn.reused_tokens == len(ids)
        del turn
        gc.collect()
        again = mamba.open_session()
        assert again.prefill(ids) is not None and again.reused_tokens == 0  # a shorter prompt
    assert expected is not None and logits is not None
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-3)
    assert int(logits.argmax()) == int(expected.argmax())
    assert not [r for r in caplog.records if "disagreed" in r.getMessage()]


def test_both_chat_adapters_decode_a_recurrent_model_plainly_unless_an_engine_is_named(
        ggufs: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    """The adapters' default engine (ReSpec) verifies drafts, which a recurrent state cannot roll
    back: unless the caller names an engine, both adapters decode plainly, say so once and report
    the engine that ran; a named one refuses the model, the same on both."""
    from llama_index.core.llms import ChatMessage

    from langchain_specrag import ChatSpeculative
    from llamaindex_specrag import SpeculativeLLM

    settings = {"model": str(ggufs["mamba"]), "backend": "llama.cpp"}
    with caplog.at_level(logging.WARNING, logger="shared_core.frontend.chat"):
        lc = ChatSpeculative(max_tokens=6, **settings).invoke(TEXT)
        li = SpeculativeLLM(max_new_tokens=6, **settings).chat(
            [ChatMessage(role="user", content=TEXT)])
    assert lc.response_metadata["engine"] == "autoregressive"
    assert li.raw is not None and li.raw["engine"] == "autoregressive"
    assert lc.content == li.message.content  # greedy, the same model and prompt
    warned = [r for r in caplog.records if "keeps a recurrent state" in r.getMessage()]
    assert len(warned) == 1
    for adapter in (lambda: ChatSpeculative(engine="respec", max_tokens=6, **settings).invoke(TEXT),
                    lambda: SpeculativeLLM(engine="respec", max_new_tokens=6, **settings).chat(
                        [ChatMessage(role="user", content=TEXT)])):
        with pytest.raises(ValueError, match=r"^ReSpec .* recurrent state"):
            adapter()
