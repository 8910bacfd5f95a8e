"""A document is known by its id AND its text (issue 28 row 1).

Framework retrievers often give every chunk of a file the file's id. RaLMSpec and RaLMSeq used to
cache the tokens, detect document swaps and compare speculated with true documents by id alone,
so the model kept reading the first text seen under an id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import pytest

from shared_core.engines.ralmspec import RaLMSpec, RaLMSpecConfig, ralmseq_generate
from shared_core.engines.ralmspec import decoding as ralm_decoding
from shared_core.engines.ralmspec.cache import LocalCache, SpeculativeRetrieval
from shared_core.retrieval import Document, Hit

TEXTS = [
    "Paris is the capital of France.",
    "Berlin is the capital of Germany.",
    "The quick brown fox jumps over the lazy dog.",
    "Question: who wrote the report? Answer: the committee wrote the report.",
]
DOCS = [Document("source.txt", text) for text in TEXTS]  # one id, four passages
QUESTION = "who wrote the report?"
SMALL = {"max_doc_tokens": 48, "query_tokens": 8}
CONFIGS = {
    "plain": RaLMSpecConfig(prefetch=False, scheduler=False, async_verify=False, **SMALL),
    "+PSA": RaLMSpecConfig(prefetch_k=4, **SMALL),
}


class OneIdRetriever:
    """Top-k by a hash of (query length bucket, text): the top-1 text changes as output grows."""

    def __init__(self) -> None:
        self.top1: list[str] = []

    @staticmethod
    def _score(query: str, doc: Document) -> float:
        key = f"{len(query) // 3}|{doc.text}".encode()
        return int(hashlib.md5(key).hexdigest()[:8], 16) / 2**32

    def encode(self, query: str) -> str:
        return query

    def search(self, encoded: Sequence[str], k: int) -> list[list[Hit]]:
        out = []
        for q in encoded:
            ranked = sorted(DOCS, key=lambda d: -self._score(q, d))[:k]
            out.append([Hit(d, self._score(q, d), r) for r, d in enumerate(ranked)])
            self.top1.append(ranked[0].text)
        return out

    def rank(self, encoded: str, docs: Sequence[Document]) -> Document:
        return max(docs, key=lambda d: self._score(encoded, d))


def _contains(ids: Sequence[int], part: Sequence[int]) -> bool:
    n = len(part)
    return any(list(ids[i : i + n]) == list(part) for i in range(len(ids) - n + 1))


@pytest.fixture
def model_inputs(monkeypatch) -> list[list[int]]:
    """Every token list the in-process decoder's KV session is synchronised to."""
    seen: list[list[int]] = []
    real = ralm_decoding.open_session

    class Recorded:
        def __init__(self, session: Any):
            self._session = session

        def sync(self, ids: Sequence[int]) -> Any:
            seen.append(list(ids))
            return self._session.sync(ids)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._session, name)

    monkeypatch.setattr(ralm_decoding, "open_session",
                        lambda *args, **kwargs: Recorded(real(*args, **kwargs)))
    return seen


def _texts_read(lm: Any, inputs: list[list[int]]) -> set[str]:
    return {t for t in TEXTS for ids in inputs if _contains(ids, lm.encode(t)[:48])}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_model_reads_every_text_returned_under_one_id(tiny_target, model_inputs,
                                                          name: str) -> None:
    retriever = OneIdRetriever()
    ref = ralmseq_generate(tiny_target, retriever, QUESTION, 24, config=CONFIGS[name])
    assert len(set(retriever.top1)) > 1  # the retriever did change the text under the id
    # every top-1 text the retriever returned is in a prompt the model read (by id alone the
    # model kept reading the first text)
    assert _texts_read(tiny_target, model_inputs) == set(retriever.top1)
    assert {d.text for d in ref.stats.documents} == set(retriever.top1)

    del model_inputs[:]
    spec = OneIdRetriever()
    out = RaLMSpec(tiny_target, spec, CONFIGS[name]).generate(QUESTION, 24)
    assert out.token_ids == ref.token_ids  # still exactly RaLMSeq
    assert set(spec.top1) <= _texts_read(tiny_target, model_inputs)


def test_the_local_cache_and_verification_tell_texts_apart() -> None:
    cache = LocalCache()
    cache.add([Hit(d, 1.0, 0) for d in DOCS[:2]])
    assert len(cache) == 2 and [d.text for d in cache.docs.values()] == TEXTS[:2]

    class Fixed:
        def search(self, queries: list[str], k: int) -> list[list[Hit]]:
            return [[Hit(DOCS[len(q) % 2], 1.0, 0)] for q in queries]

    speculative = SpeculativeRetrieval(Fixed(), k=1)
    speculative.retrieve("ab")  # caches DOCS[0]
    assert speculative.speculate("abc")[0].document == DOCS[0]  # true top-1 is DOCS[1]
    assert speculative.verify() == [False]  # same id, other text: a wrong speculation
