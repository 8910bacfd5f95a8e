"""RaLMSpec in LangChain: iterative retrieval-augmented generation, identical output, fewer
blocking retrievals. Runs offline with the embedded SmolLM2.

    python examples/ralmspec_langchain.py
"""

from __future__ import annotations

import logging

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever

from langchain_specrag import RaLMSpecRunnable, SpeculativeRetriever
from shared_core import load_lm
from shared_core.engines.ralmspec import RaLMSpec
from shared_core.retrieval import BM25Retriever
from shared_core.retrieval import Document as SpecDocument

logging.basicConfig(level=logging.WARNING)
logger = logging.getLogger("ralmspec_example")
logger.setLevel(logging.INFO)

PASSAGES = [
    "Wilhelm Conrad Röntgen received the first Nobel Prize in Physics in 1901 for X-rays.",
    "Marie Curie won Nobel Prizes in Physics (1903) and Chemistry (1911).",
    "The Nobel Prize is awarded in Stockholm, except the Peace Prize, awarded in Oslo.",
    "X-rays are electromagnetic radiation with wavelengths from 10 picometres to 10 nanometres.",
]


class KeywordRetriever(BaseRetriever):
    """Any LangChain retriever works; this one wraps a BM25 index over PASSAGES."""

    index: BM25Retriever

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun
                                ) -> list[Document]:
        hits = self.index.search([query], 2)[0]
        return [Document(page_content=h.document.text, id=h.document.id) for h in hits]


def main() -> None:
    index = BM25Retriever()
    index.add([SpecDocument(f"p{i}", text) for i, text in enumerate(PASSAGES)])
    retriever = KeywordRetriever(index=index)

    # 1. RaLMSpec as a Runnable: retrieve every 4 tokens, speculate from a local cache.
    engine = RaLMSpec(load_lm("smollm2-135m-instruct"), retriever)  # or pass retriever= + model=
    ralmspec = RaLMSpecRunnable(engine=engine, max_new_tokens=48, with_details=True)
    out = ralmspec.invoke("Who won the first Nobel Prize in Physics?")
    assert isinstance(out, dict)  # with_details=True
    stats = out["stats"]
    logger.info("answer: %s", out["answer"])
    logger.info("documents per step: %s", out["doc_ids"])
    logger.info("retriever calls %d for %d steps (speculated %d, correct %d), strides %s",
                stats["extra"]["retrieval_calls"], len(out["doc_ids"]), stats["drafted"],
                stats["accepted"], stats["extra"]["strides"])

    # The same chain without speculation (RaLMSeq) produces the same tokens.
    baseline = RaLMSpecRunnable(engine=engine, max_new_tokens=48, with_details=True, baseline=True)
    same = baseline.invoke("Who won the first Nobel Prize in Physics?")
    assert isinstance(same, dict)
    logger.info("identical to RaLMSeq: %s", same["token_ids"] == out["token_ids"])

    # 2. SpeculativeRetriever for your own iterative loop (agents, FLARE-style chains).
    spec = SpeculativeRetriever(retriever=retriever, k=1)
    spec.invoke("Nobel Prize in Physics")  # exact; fills the cache
    guesses = [spec.speculate(q) for q in ("first Nobel Prize", "X-rays discovery")]
    verdicts = spec.verify()  # one batched call for both queries
    for guess, ok in zip(guesses, verdicts, strict=True):
        logger.info("speculated %r -> %s", guess[0].page_content[:40], "ok" if ok else "roll back")


if __name__ == "__main__":
    main()
