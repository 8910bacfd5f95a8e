"""The retriever calls an engine makes inside a LangChain runnable are traced as children of the
runnable's run, on every path (sync, async, streamed): the retriever's runs must not vanish from
LangSmith or a callback handler because a call ran on a worker thread."""

from __future__ import annotations

from typing import Any

import pytest
from fakes import LCRetriever
from langchain_core.callbacks import BaseCallbackHandler

from langchain_specrag import RaLMSpecRunnable
from shared_core.engines.ralmspec import RaLMSpec, RaLMSpecConfig
from shared_core.retrieval import Document, Hit

TEXTS = ["Paris is the capital of France.", "Berlin is the capital of Germany.",
         "Question: who wrote the report? Answer: the committee wrote the report."]
QUESTION = "who wrote the report?"


def _hits(query: str) -> list[Hit]:
    order = sorted(range(len(TEXTS)), key=lambda i: hash((len(query) % 3, i)) % 7)
    return [Hit(Document(f"t{i}", TEXTS[i]), 1.0 / (r + 1), r) for r, i in enumerate(order)]


class Runs(BaseCallbackHandler):
    def __init__(self) -> None:
        self.chains: list[Any] = []
        self.retrievals: list[Any] = []  # parent run ids

    def on_chain_start(self, serialized: Any, inputs: Any, *, run_id: Any,
                       parent_run_id: Any = None, **kwargs: Any) -> None:
        if parent_run_id is None:
            self.chains.append(run_id)

    def on_retriever_start(self, serialized: Any, query: str, *, run_id: Any,
                           parent_run_id: Any = None, **kwargs: Any) -> None:
        self.retrievals.append(parent_run_id)


@pytest.mark.parametrize("how", ["invoke", "stream", "ainvoke", "astream"])
async def test_ralmspec_runnables_retriever_runs_are_its_children(tiny_target, how: str) -> None:
    retriever = LCRetriever(_hits)
    engine = RaLMSpec(tiny_target, retriever, RaLMSpecConfig(max_doc_tokens=32, query_tokens=8,
                                                             prefetch_k=3))
    runnable = RaLMSpecRunnable(engine=engine, max_new_tokens=12)
    runs = Runs()
    config: Any = {"callbacks": [runs]}
    if how == "invoke":
        runnable.invoke(QUESTION, config=config)
    elif how == "stream":
        list(runnable.stream(QUESTION, config=config))
    elif how == "ainvoke":
        await runnable.ainvoke(QUESTION, config=config)
    else:
        [chunk async for chunk in runnable.astream(QUESTION, config=config)]
    assert len(runs.chains) == 1 and retriever.calls > 0
    assert runs.retrievals == [runs.chains[0]] * retriever.calls


def test_a_stream_stepped_in_its_context_is_closed_when_its_consumer_stops() -> None:
    from contextvars import ContextVar

    from shared_core.frontend.serving import iterate_in_context

    where: ContextVar[str] = ContextVar("where", default="outside")
    seen: list[str] = []

    def steps():
        try:
            for i in range(10):
                seen.append(where.get())
                yield i
        finally:
            seen.append(f"closed in {where.get()}")

    token = where.set("the call")
    stream = iterate_in_context(steps())
    where.reset(token)
    assert next(stream) == 0 and next(stream) == 1
    stream.close()
    assert seen == ["the call", "the call", "closed in the call"]
