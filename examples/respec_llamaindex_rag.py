"""ReSpec as the LLM of a LlamaIndex query engine, fully offline.

Where an app writes ``index.as_query_engine(llm=...)``, it passes ``SpeculativeLLM()``: the
retrieved nodes are in the prompt, ReSpec drafts the spans the answer copies from them and the
target verifies them (strict: same text as plain greedy decoding). Settings.embed_model is set to
the embedded MiniLM explicitly, so nothing reaches for OpenAI.

Run: python examples/respec_llamaindex_rag.py
"""

from __future__ import annotations

import asyncio
import time

from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.core.base.response.schema import Response, StreamingResponse

from llamaindex_specrag import SpecragEmbedding, SpeculativeLLM

PASSAGES = [
    "The Hollin Weir was built in 1874 by the engineer Marta Quell to control the river Dast.",
    "The weir has eleven sluice gates, each named after a month of the year except June.",
    "The weir keeper's cottage, painted blue, stands on the east bank next to the fish ladder.",
    "Marta Quell also designed the iron footbridge at Pellow, finished in 1881.",
    "The river Dast floods every few winters; the worst flood on record was in 1911.",
    "Salmon use the fish ladder beside the Hollin Weir to swim upstream each autumn.",
]


def main() -> None:
    Settings.embed_model = SpecragEmbedding()  # embedded MiniLM, offline
    index = VectorStoreIndex.from_documents([Document(text=p) for p in PASSAGES])
    question = "Who built the Hollin Weir, and when?"
    for engine in ("respec", "autoregressive"):
        llm = SpeculativeLLM(model="smollm2-135m-instruct", engine=engine, max_new_tokens=64)
        query_engine = index.as_query_engine(llm=llm, similarity_top_k=3)
        query_engine.query(question)  # warm-up (loads the model once per process)
        start = time.perf_counter()
        response = query_engine.query(question)
        assert isinstance(response, Response)  # as_query_engine() without streaming
        print(f"[{engine}] {time.perf_counter() - start:.2f} s: {response.response!r}")

    llm = SpeculativeLLM(model="smollm2-135m-instruct", max_new_tokens=64)
    out = llm.complete("Repeat exactly: " + PASSAGES[0])
    assert out.raw is not None
    stats = out.raw["speculative_stats"]
    print("complete():", repr(out.text))
    print("tokens per target forward (MAT):", round(stats["tokens_per_target_forward"], 2),
          "| sources:", stats["extra"]["sources"])
    streaming = index.as_query_engine(llm=llm, streaming=True, similarity_top_k=3)
    streamed = streaming.query(question)
    assert isinstance(streamed, StreamingResponse)
    for piece in streamed.response_gen:
        print(piece, end="|", flush=True)
    print()
    answer = asyncio.run(index.as_query_engine(llm=llm).aquery("What is next to the cottage?"))
    assert isinstance(answer, Response)
    print("async:", answer.response)


if __name__ == "__main__":
    main()
