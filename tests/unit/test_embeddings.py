"""SpecragEmbeddings (LangChain) and SpecragEmbedding (LlamaIndex) on a tiny sentence-transformers
model built in-process: settings checks, named input errors before any model work, lazy shared
loading, query/document prompts, identical vectors from both adapters, settings-only pickling.
The embedded MiniLM runs in tests/integration/test_embeddings_embedded.py."""

from __future__ import annotations

import asyncio
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from langchain_tests.unit_tests import EmbeddingsUnitTests
from pydantic import ValidationError

from langchain_specrag import SpecragEmbeddings
from llamaindex_specrag import SpecragEmbedding
from shared_core.retrieval import embedding as shared
from shared_core.runtime import model_cache

UNREACHABLE = "nobody-here/no-such-embedder"  # a hub id that cannot load (offline tests)
TEXTS = ["the cat sat on a mat", "paris is the capital of france", "a dog ran in the park"]
PROMPTS = {"query": "query: ", "document": "passage: "}
WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "in", "park", "paris", "is", "capital",
         "of", "france", "query", "passage", ":"]
MAX_PICKLE_BYTES = 2048


def _tiny_st(folder: Path, prompts: dict[str, str] | None) -> str:
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    hf = folder / "hf"
    hf.mkdir()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=32, max_position_embeddings=64)
    BertModel(config).save_pretrained(hf)
    BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(hf)
    st = SentenceTransformer(str(hf), device="cpu", prompts=prompts)  # mean pooling over BERT
    st.save(str(folder / "st"))
    return str(folder / "st")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _tiny_st(tmp_path_factory.mktemp("tiny-st"), None)


@pytest.fixture(scope="module")
def prompted_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _tiny_st(tmp_path_factory.mktemp("tiny-st-prompts"), PROMPTS)


class TestSpecragEmbeddingsStandardUnit(EmbeddingsUnitTests):
    """langchain-tests' unit suite (construction from params; no model is loaded)."""

    @property
    def embeddings_class(self) -> type[SpecragEmbeddings]:
        return SpecragEmbeddings

    @property
    def embedding_model_params(self) -> dict:
        return {"model": "all-minilm-l6-v2", "device": "cpu"}


def test_construction_and_adapter_import_leave_torch_out() -> None:
    code = ("import sys\nfrom langchain_specrag import SpecragEmbeddings\n"
            "from llamaindex_specrag import SpecragEmbedding\n"
            "SpecragEmbeddings(); SpecragEmbedding(); SpecragEmbeddings().embed_documents([])\n"
            "heavy = [m for m in ('torch', 'transformers', 'sentence_transformers')"
            " if m in sys.modules]\nassert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]


# ------------------------------------------------------------------ settings

@pytest.mark.parametrize(("kwargs", "error", "names"), [
    ({"model": 3}, (TypeError, ValidationError), "model"),
    ({"model": "no-such-alias"}, ValueError, "model"),
    ({"batch_size": 0}, ValueError, "batch_size"),
    ({"batch_size": "8"}, ValidationError, "batch_size"),
    ({"batch_size": True}, ValidationError, "batch_size"),
    ({"normalize": "yes"}, ValidationError, "normalize"),
    ({"show_progress": 1}, ValidationError, "show_progress"),
    ({"device": "gpu"}, ValueError, "device"),
    ({"device": 0}, (TypeError, ValidationError), "device"),
    ({"temperature": 0.5}, ValidationError, "temperature"),
])
@pytest.mark.parametrize("cls", [SpecragEmbeddings, SpecragEmbedding])
def test_bad_settings_name_the_setting(cls: type, kwargs: dict, error: type, names: str) -> None:
    with pytest.raises(error, match=names):
        cls(**kwargs)


@pytest.mark.parametrize(("kwargs", "error", "name"), [
    ({"model": 3}, TypeError, "model"),
    ({"model": "no-such-alias"}, ValueError, "model"),
    ({"batch_size": 0}, ValueError, "batch_size"),
    ({"batch_size": 2.0}, TypeError, "batch_size"),
    ({"normalize": 1}, TypeError, "normalize"),
    ({"device": "cuda:x"}, ValueError, "device"),
])
def test_shared_config_checks(kwargs: dict, error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        shared.EmbeddingConfig(**kwargs)


def test_aliases_of_setting_names() -> None:
    assert SpecragEmbeddings(model_name="all-minilm-l6-v2").model == "all-minilm-l6-v2"
    li = SpecragEmbedding(model="org/some-model", batch_size=7)
    assert (li.model_name, li.embed_batch_size) == ("org/some-model", 7)
    assert SpecragEmbedding(model_name="org/x", embed_batch_size=3).embed_batch_size == 3


def test_defaults_come_from_the_shared_config() -> None:
    lc, li, config = SpecragEmbeddings(), SpecragEmbedding(), shared.EmbeddingConfig()
    assert (lc.model, lc.device, lc.batch_size, lc.normalize, lc.show_progress) == (
        config.model, config.device, config.batch_size, config.normalize, config.show_progress)
    assert (li.model_name, li.device, li.embed_batch_size, li.normalize) == (
        config.model, config.device, config.batch_size, config.normalize)


# ------------------------------------------------------------------ input checks (before loading)

@pytest.mark.parametrize(("call", "name"), [
    (lambda e: e.embed_documents("one string"), "texts"),
    (lambda e: e.embed_documents(["ok", 3]), r"texts\[1\]"),
    (lambda e: e.embed_documents(None), "texts"),
    (lambda e: e.embed_documents({"a": 1}), "texts"),
    (lambda e: e.embed_query(None), "text"),
    (lambda e: e.embed_query(["a list"]), "text"),
    (lambda e: asyncio.run(e.aembed_documents("one string")), "texts"),
    (lambda e: asyncio.run(e.aembed_query(7)), "text"),
])
def test_langchain_bad_input_is_named_before_loading(call, name: str) -> None:
    # the model cannot load: a load attempt would raise OSError, not TypeError
    with pytest.raises(TypeError, match=name):
        call(SpecragEmbeddings(model=UNREACHABLE))


@pytest.mark.parametrize(("call", "name"), [
    (lambda e: e.get_text_embedding_batch("one string"), "texts"),
    (lambda e: e.get_text_embedding_batch(["ok"] * 40 + [None]), r"texts\[40\]"),
    (lambda e: e.get_query_embedding(3), "query"),
    (lambda e: e.get_text_embedding(b"bytes"), "text"),
    (lambda e: asyncio.run(e.aget_query_embedding(None)), "query"),
    (lambda e: asyncio.run(e.aget_text_embedding_batch(["ok", 1.5])), r"texts\[1\]"),
])
def test_llamaindex_bad_input_is_named_before_loading(call, name: str) -> None:
    with pytest.raises(TypeError, match=name):
        call(SpecragEmbedding(model_name=UNREACHABLE))


def test_no_texts_loads_nothing() -> None:
    assert SpecragEmbeddings(model=UNREACHABLE).embed_documents([]) == []
    assert SpecragEmbedding(model_name=UNREACHABLE).get_text_embedding_batch([]) == []


def test_failed_load_caches_nothing() -> None:
    with pytest.raises(OSError):
        SpecragEmbeddings(model=UNREACHABLE, device="cpu").embed_query("x")
    assert (UNREACHABLE, "cpu") not in model_cache._EMBEDDERS


# ------------------------------------------------------------------ embedding

def test_lazy_load_shared_by_copies(tiny_folder: str) -> None:
    model_cache._EMBEDDERS.pop((tiny_folder, "cpu"), None)
    first = SpecragEmbeddings(model=tiny_folder, device="cpu")
    assert (tiny_folder, "cpu") not in model_cache._EMBEDDERS  # construction loads nothing
    first.embed_query("the cat")
    loaded = model_cache._EMBEDDERS[(tiny_folder, "cpu")]
    SpecragEmbedding(model_name=tiny_folder, device="cpu").get_query_embedding("the dog")
    assert model_cache.cached_embedder(tiny_folder, "cpu") is loaded


def test_both_adapters_give_the_same_vectors(tiny_folder: str) -> None:
    lc = SpecragEmbeddings(model=tiny_folder, device="cpu")
    li = SpecragEmbedding(model_name=tiny_folder, device="cpu")
    docs = lc.embed_documents(TEXTS)
    assert docs == li.get_text_embedding_batch(TEXTS)
    assert docs[1] == li.get_text_embedding(TEXTS[1]) == lc.embed_documents([TEXTS[1]])[0]
    assert lc.embed_query(TEXTS[0]) == li.get_query_embedding(TEXTS[0])
    assert all(isinstance(x, float) for x in docs[0]) and len(docs[0]) == 16
    assert not np.allclose(docs[0], docs[1])


def test_async_matches_sync(tiny_folder: str) -> None:
    lc = SpecragEmbeddings(model=tiny_folder, device="cpu")
    li = SpecragEmbedding(model_name=tiny_folder, device="cpu")

    async def run() -> tuple:
        return await asyncio.gather(lc.aembed_documents(TEXTS), lc.aembed_query(TEXTS[2]),
                                    li.aget_text_embedding_batch(TEXTS),
                                    li.aget_query_embedding(TEXTS[2]),
                                    li.aget_text_embedding(TEXTS[0]))

    docs, query, li_docs, li_query, li_one = asyncio.run(run())
    assert docs == li_docs == lc.embed_documents(TEXTS)
    assert query == li_query == lc.embed_query(TEXTS[2])
    assert li_one == docs[0]


def test_normalize_setting(tiny_folder: str) -> None:
    raw_model = model_cache.cached_embedder(tiny_folder, "cpu")
    raw = SpecragEmbeddings(model=tiny_folder, device="cpu", normalize=False).embed_documents(TEXTS)
    unit = SpecragEmbeddings(model=tiny_folder, device="cpu").embed_documents(TEXTS)
    expected = raw_model.encode(TEXTS, convert_to_numpy=True)
    np.testing.assert_allclose(raw, expected, rtol=1e-6, atol=1e-7)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(unit, expected / np.linalg.norm(expected, axis=1, keepdims=True),
                               rtol=1e-5, atol=1e-6)


def test_batch_size_is_a_setting_not_a_result_change(tiny_folder: str) -> None:
    one = SpecragEmbeddings(model=tiny_folder, device="cpu", batch_size=1).embed_documents(TEXTS)
    many = SpecragEmbeddings(model=tiny_folder, device="cpu", batch_size=64).embed_documents(TEXTS)
    np.testing.assert_allclose(one, many, rtol=1e-5, atol=1e-6)


def test_model_prompts_for_queries_and_documents(prompted_folder: str) -> None:
    raw_model = model_cache.cached_embedder(prompted_folder, "cpu")
    lc = SpecragEmbeddings(model=prompted_folder, device="cpu")
    li = SpecragEmbedding(model_name=prompted_folder, device="cpu")
    query, doc = lc.embed_query("the cat"), lc.embed_documents(["the cat"])[0]
    assert query == li.get_query_embedding("the cat")
    assert doc == li.get_text_embedding("the cat")
    expected = raw_model.encode(["query: the cat", "passage: the cat"], prompt_name=None,
                                normalize_embeddings=True, batch_size=1)
    np.testing.assert_allclose([query, doc], expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(query, doc)


# ------------------------------------------------------------------ pickling

@pytest.mark.parametrize("cls", [SpecragEmbeddings, SpecragEmbedding])
def test_pickle_carries_settings_not_weights(cls: type, tiny_folder: str) -> None:
    component = cls(model=tiny_folder, device="cpu", batch_size=4, normalize=False)
    before = component.embed_documents(TEXTS) if cls is SpecragEmbeddings else \
        component.get_text_embedding_batch(TEXTS)
    data = pickle.dumps(component)
    assert len(data) < MAX_PICKLE_BYTES, len(data)
    copy = pickle.loads(data)
    assert (copy.batch_size if cls is SpecragEmbeddings else copy.embed_batch_size) == 4
    assert copy.normalize is False
    after = copy.embed_documents(TEXTS) if cls is SpecragEmbeddings else \
        copy.get_text_embedding_batch(TEXTS)
    assert after == before
