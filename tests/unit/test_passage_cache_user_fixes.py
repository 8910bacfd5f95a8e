"""The passage cache's user-facing edges (notes/audit_passage_cache.md, findings 2, 3, 5, 6, 8
and 9) on tiny torch models: what ``warm_passages`` accepts and reports, settings given without
``passage_cache``, budgets that keep nothing, ``clear_passages`` giving a cold read, and the
chat adapters taken in place of their model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from fakes import PASSAGES
from tiny import tiny_llama, tiny_lm, tiny_tokenizer

from shared_core.config import PassageCacheConfig
from shared_core.runtime.passage_cache import (
    ModelProvider,
    attach,
    chunk_head,
    clear_passages,
    config_from,
    passage_stats,
    register_passages,
    warm_passages,
)
from shared_core.runtime.passage_cache.chunks import MIN_PASSAGE
from shared_core.runtime.passage_cache.store import ChunkStore
from shared_core.runtime.torch import prefix

LOGGER = "shared_core.runtime.passage_cache"


def blend_lm(seed: int, **kwargs: int) -> Any:
    lm = tiny_lm(num_layers=1, seed=seed, **kwargs)
    attach(lm.model, PassageCacheConfig(mode="blend", disk_mb=0), head=chunk_head(lm))
    return lm


def prompt_of(lm: Any, order: list[int], question: str = "Who built the weir?") -> list[int]:
    text = "Context:\n" + "\n\n".join(PASSAGES[i] for i in order) + f"\n\nQuestion: {question}"
    ids: list[int] = lm.prompt_ids([{"role": "user", "content": text}])
    return ids


def prefill(lm: Any, ids: list[int]) -> Any:
    session = lm.open_session()
    session.prefill(ids)
    return session.passage_report


# -- finding 9: a {doc_id: text} dict; too short apart from already stored ------------------------

def test_a_dict_of_texts_is_refused_naming_texts() -> None:
    lm = blend_lm(seed=21)
    for call in (warm_passages, register_passages):
        with pytest.raises(TypeError, match=r"texts is a dict.*pass texts\.values\(\)"):
            call(lm, {"doc-1": PASSAGES[0]})
    assert warm_passages(lm, {"doc-1": PASSAGES[0]}.values(), progress=False)["computed"] == 1


def test_too_short_passages_are_counted_apart_and_logged_once(caplog: Any) -> None:
    lm = blend_lm(seed=22)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first = warm_passages(lm, [PASSAGES[0], "Short one.", "Also short."], progress=False)
    assert first == {"passages": 3, "computed": 1, "skipped": 0, "too_short": 2,
                     "too_long": 0, "not_kept": 0}
    lines = [r.getMessage() for r in caplog.records if "too short" in r.getMessage()]
    assert len(lines) == 1
    assert "texts[1]" in lines[0] and f"MIN_PASSAGE={MIN_PASSAGE}" in lines[0]
    again = warm_passages(lm, [PASSAGES[0], "Short one."], progress=False)
    assert again["skipped"] == 1 and again["too_short"] == 1 and again["computed"] == 0


# -- finding 8: settings given without passage_cache ----------------------------------------------

@pytest.mark.parametrize(("settings", "error", "match"), [
    ({"recompute_share": 0.3}, ValueError, r"recompute_share=0\.3 needs passage_cache='blend'"),
    ({"memory_mb": 64}, ValueError, "passage_cache_memory_mb=64 needs passage_cache="),
    ({"disk_mb": 0}, ValueError, "passage_cache_disk_mb=0 needs passage_cache="),
    ({"recompute_share": "lots"}, TypeError, "recompute_share"),
    ({"memory_mb": -5}, ValueError, "passage_cache_memory_mb"),
    ({"disk_mb": "big"}, TypeError, "passage_cache_disk_mb"),
])
def test_a_setting_without_passage_cache_is_refused(settings: dict[str, Any],
                                                    error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        config_from(None, **settings)


def test_defaults_without_passage_cache_are_accepted(tiny_model_folder: str) -> None:
    from langchain_specrag.chat_models.speculative import ChatSpeculative
    from llamaindex_specrag.llms.speculative import SpeculativeLLM
    from shared_core.runtime.models import load_lm

    defaults = PassageCacheConfig()
    assert config_from(None, recompute_share=defaults.recompute_share,
                       memory_mb=defaults.memory_mb, disk_mb=defaults.disk_mb) is None
    assert config_from(None, recompute_share=None, memory_mb=None, disk_mb=None) is None
    ChatSpeculative()  # the settings' defaults are passed as given
    SpeculativeLLM()
    for cls in (ChatSpeculative, SpeculativeLLM):
        with pytest.raises(ValueError, match=r"recompute_share=0\.3 needs passage_cache='blend'"):
            cls(recompute_share=0.3)
    with pytest.raises(ValueError, match="passage_cache_memory_mb=8 needs passage_cache"):
        load_lm(tiny_model_folder, backend="torch", passage_cache_memory_mb=8)


# -- finding 6: budgets that keep nothing -------------------------------------------------------

def test_no_budget_at_all_is_refused() -> None:
    with pytest.raises(ValueError, match="passage_cache_memory_mb=0 with passage_cache_disk_mb=0"):
        PassageCacheConfig(mode="blend", memory_mb=0, disk_mb=0)
    PassageCacheConfig(mode="blend", memory_mb=0, disk_mb=1)
    PassageCacheConfig(mode="blend", memory_mb=1, disk_mb=0)


def test_put_says_whether_the_entry_was_kept(tmp_path: Path, caplog: Any) -> None:
    store: ChunkStore[bytes] = ChunkStore("a" * 64, memory_bytes=100, disk_bytes=300,
                                          disk_dir=tmp_path)
    with caplog.at_level(logging.WARNING):
        assert store.put("01" * 32, b"x" * 80) is True  # memory
        assert store.put("02" * 32, b"x" * 150) is True  # disk only
        assert store.put("03" * 32, b"x" * 400) is False  # neither
        assert store.put("04" * 32, b"x" * 500) is False
    store.flush()
    assert store.stats.not_kept == 2 and "03" * 32 not in store
    warned = [r.getMessage() for r in caplog.records if "not kept" in r.getMessage()]
    assert len(warned) == 1 and "passage_cache_memory_mb" in warned[0]


def test_warm_passages_counts_entries_not_kept_and_warns_once(caplog: Any) -> None:
    lm = blend_lm(seed=23)
    cache = lm.model.passage_cache
    cache.store.memory_budget = 100  # below one passage's KV (no disk tier)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result = warm_passages(lm, PASSAGES, progress=False)
    assert result["computed"] == 3 and result["not_kept"] == 3
    warned = [r.getMessage() for r in caplog.records
              if r.name == LOGGER and "not kept" in r.getMessage()]
    assert len(warned) == 1 and "3 of 3" in warned[0]
    report = prefill(lm, prompt_of(lm, [0, 1]))
    assert report.unseen > 0 and report.stored == 0  # read, and nothing could be kept


# -- finding 5: passages longer than the window --------------------------------------------------

def test_a_passage_longer_than_the_window_is_skipped_before_any_model_work(
        caplog: Any, monkeypatch: Any) -> None:
    lm = blend_lm(seed=24, max_positions=120)  # head 7 + PASSAGES[0]'s 119 ids do not fit
    cache = lm.model.passage_cache
    warmed: list[int] = []
    original = cache.warm
    monkeypatch.setattr(cache, "warm", lambda lm_, ids: warmed.append(len(ids)) or original(
        lm_, ids))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result = warm_passages(lm, [PASSAGES[2], PASSAGES[0]], progress=False)
    assert result == {"passages": 2, "computed": 1, "skipped": 0, "too_short": 0,
                      "too_long": 1, "not_kept": 0}
    assert len(warmed) == 1  # PASSAGES[0] never reached the model
    lines = [r.getMessage() for r in caplog.records if "window" in r.getMessage()]
    assert len(lines) == 1
    assert "texts[1]" in lines[0] and "119 ids" in lines[0] and "120-token window" in lines[0]


# -- finding 3: clear_passages gives a cold read ------------------------------------------------

@pytest.mark.parametrize("mode", ["exact", "blend"])
def test_clear_passages_also_forgets_the_prompt_prefixes(mode: str) -> None:
    lm = tiny_lm(num_layers=1, seed=25)
    prefix.attach(lm.model, 64 << 20)
    attach(lm.model, PassageCacheConfig(mode=mode, disk_mb=0), head=chunk_head(lm))
    ids = prompt_of(lm, [0, 1])
    prefill(lm, ids)
    warm = prefill(lm, ids)
    assert warm.kept + warm.reused > 0
    clear_passages(lm)
    cold = prefill(lm, ids)
    assert cold.kept == 0 and cold.reused == 0
    assert cold.read == len(ids)


# -- finding 2: a chat adapter in place of its model ---------------------------------------------

def _model_folder(path: Path, seed: int) -> str:
    tiny_llama(num_layers=1, seed=seed).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("framework", ["langchain", "llamaindex"])
def test_warm_passages_takes_a_chat_adapter_and_its_calls_reuse_them(
        framework: str, tmp_path: Path) -> None:
    from shared_core.frontend.serving import release

    folder = _model_folder(tmp_path / "model", seed=26 if framework == "langchain" else 27)
    settings: dict[str, Any] = {"model": folder, "backend": "torch",
                                "engine": "autoregressive", "passage_cache": "blend",
                                "passage_cache_disk_mb": 0}
    question = ("Context:\n" + "\n\n".join(PASSAGES[i] for i in (2, 0, 1))
                + "\n\nQuestion: Who built the weir?")
    try:
        if framework == "langchain":
            from langchain_core.messages import HumanMessage

            from langchain_specrag.chat_models.speculative import ChatSpeculative

            adapter: Any = ChatSpeculative(max_tokens=2, **settings)
            assert isinstance(adapter, ModelProvider)
            assert warm_passages(adapter, PASSAGES, progress=False)["computed"] == 3
            report = adapter.invoke([HumanMessage(question)]).response_metadata["passage_cache"]
        else:
            from llama_index.core.base.llms.types import ChatMessage, MessageRole

            from llamaindex_specrag.llms.speculative import SpeculativeLLM

            adapter = SpeculativeLLM(max_new_tokens=2, **settings)
            assert isinstance(adapter, ModelProvider)
            assert warm_passages(adapter, PASSAGES, progress=False)["computed"] == 3
            report = adapter.chat([ChatMessage(role=MessageRole.USER, content=question)]
                                  ).raw["passage_cache"]
        assert report["reused"] > 0 and report["unseen"] == 0
        assert adapter.loaded_model() is adapter.loaded_model()  # the shared copy, every call
        assert passage_stats(adapter)["last"]["reused"] == report["reused"]
        assert register_passages(adapter, PASSAGES) == 3
        clear_passages(adapter)
        assert warm_passages(adapter, PASSAGES, progress=False)["computed"] == 3
    finally:
        release(folder)


# -- finding 4: one disk budget for every process writing the folder ---------------------------

def test_the_disk_budget_holds_for_stores_sharing_a_folder(tmp_path: Path) -> None:
    """Two stores of one model on one folder (as two processes hold them, each with its own
    counters): together they stay within the budget, and each reports the folder's total."""
    budget = 1000
    one, two = (ChunkStore[bytes]("b" * 64, memory_bytes=0, disk_bytes=budget, disk_dir=tmp_path)
                for _ in range(2))
    for i, store in enumerate((one, two, one, two, one, two)):
        assert store.put(f"{i:02x}" * 32, bytes([i]) * 200)  # 270 bytes on disk each
        store.flush()
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.kv"))
    assert on_disk <= budget
    assert one.stats.disk_bytes <= budget
    assert two.stats.disk_bytes == on_disk  # the last writer's view is the folder's
    assert one.stats.evictions + two.stats.evictions == 3
    assert two.clear() == 3 and not list(tmp_path.rglob("*.kv"))
    third = ChunkStore[bytes]("b" * 64, memory_bytes=0, disk_bytes=budget, disk_dir=tmp_path)
    assert third.stats.disk_bytes == 0


def test_warm_passages_names_the_cache_a_model_has_when_it_is_not_blend() -> None:
    """An exact cache is named as such (before: "without one", though the model had one)."""
    lm = tiny_lm(num_layers=1, seed=27)
    with pytest.raises(ValueError, match=r"got LM without one"):
        warm_passages(lm, PASSAGES, progress=False)
    attach(lm.model, PassageCacheConfig(mode="exact", disk_mb=0))
    with pytest.raises(ValueError, match=r"got LM with passage_cache='exact'"):
        warm_passages(lm, PASSAGES, progress=False)
