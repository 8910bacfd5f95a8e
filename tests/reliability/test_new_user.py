"""What a new user meets first (issue 28 rows 13 and 14): a quiet console and a complete dir().

- Row 13: bm25s sets its own logger to DEBUG when imported, so on a console the user configured
  (``logging.basicConfig``: a root handler of level NOTSET) every BM25 index printed bm25s' debug
  lines. The test attaches such a handler, builds and searches an index, and finds none.
- Row 14: the packages resolve their public names lazily (PEP 562); ``dir()`` listed only what
  was already imported, so tab completion missed ``load_lm``, ``ReSpecDecoder``...
"""

from __future__ import annotations

import importlib
import logging

import pytest

from shared_core.retrieval import BM25Retriever, Document


class Records(logging.Handler):
    """A root handler like ``logging.basicConfig``'s: level NOTSET, so it shows what arrives."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_bm25_retrieval_prints_no_third_party_debug_lines() -> None:
    root, handler = logging.getLogger(), Records()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)  # a user who asked for INFO: no DEBUG line may reach them
    try:
        bm25 = BM25Retriever()
        bm25.add([Document("a", "the lazy dog sleeps"), Document("b", "a quick brown fox")])
        assert bm25.search(["lazy dog"], 1)[0][0].document.id == "a"
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    noisy = [f"{r.name}: {r.getMessage()}" for r in handler.records if r.levelno < logging.INFO]
    assert noisy == []
    assert logging.getLogger().handlers.count(handler) == 0  # and nothing configured the root


def test_a_level_the_user_sets_on_bm25s_is_kept() -> None:
    bm25s_logger = logging.getLogger("bm25s")
    before = bm25s_logger.level
    try:
        BM25Retriever().add([Document("a", "one text")])  # bm25s imported and quieted once
        bm25s_logger.setLevel(logging.DEBUG)  # the user wants bm25s' debug lines now
        BM25Retriever().add([Document("a", "one text")])
        assert bm25s_logger.level == logging.DEBUG
    finally:
        bm25s_logger.setLevel(before)


@pytest.mark.parametrize(("package", "names"), [
    ("shared_core", ["LM", "load_embedder", "load_lm"]),
    ("shared_core.engines", ["RaLMSpec", "RapidDecoder", "ReSpecDecoder", "SpeculativeRAG",
                             "autoregressive_generate", "speculative_generate"]),
    ("shared_core.remote", ["RemoteConfig", "RemoteLM"]),
    ("langchain_specrag", ["ChatSpeculative", "RaLMSpecRunnable", "SpecragEmbeddings",
                           "SpeculativeRAGRunnable", "SpeculativeRetriever"]),
    ("llamaindex_specrag", ["RaLMSpecQueryEngine", "SpecragEmbedding", "SpeculativeLLM",
                            "SpeculativeRAGQueryEngine", "SpeculativeRetriever"]),
])
def test_dir_lists_the_lazily_loaded_public_names(package: str, names: list[str]) -> None:
    module = importlib.import_module(package)
    listed = dir(module)
    assert set(names) <= set(listed), sorted(set(names) - set(listed))
    assert set(module.__all__) <= set(listed)
    assert "__name__" in listed and listed == sorted(listed)  # the module's own names as well
